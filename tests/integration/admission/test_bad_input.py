"""Bad records on the priority topics (hypothesis): each becomes one dead letter with an
excerpt of its bytes, its digest and a reason, and admission keeps admitting the good
requests around them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from schemas import Priority
from seawall_client.kafka import ensure_topics
from seawall_client.serde import REQUEST, DecodeError, decode
from services.admission.service import Admission
from services.common.bus import topics_of
from services.common.deadletters import screened_excerpt
from services.common.settings import CommonSettings
from tests.admission_helpers import (
    TopicReader,
    admission_settings,
    capacity_feed,
    inference_request,
    send_all,
)

VALID = json.loads(inference_request("template", "llm.reply.template").model_dump_json())
REASONS = {
    "empty_record",
    "invalid_utf8",
    "invalid_json",
    "unsupported_version",
    "schema_violation",
}


def undecodable(raw: bytes | None) -> bool:
    try:
        decode(REQUEST, raw)
    except DecodeError:
        return True
    return False


json_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def mutated(field: str, value: Any) -> bytes:
    doc = dict(VALID)
    doc[field] = value
    return json.dumps(doc).encode()


bad_records = st.one_of(
    st.none(),
    st.binary(max_size=48),
    st.text(max_size=24).map(str.encode),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.builds(mutated, st.sampled_from(sorted(VALID)), json_values),
    st.builds(mutated, st.just("schema_version"), st.integers(2, 99)),
    st.builds(mutated, st.just("surprise"), json_values),
).filter(undecodable)


def test_bad_records_are_dead_lettered_and_admission_carries_on(
    settings: CommonSettings,
) -> None:
    topics = topics_of(settings)
    counter = itertools.count()
    expected: Counter[tuple[str, bytes]] = Counter()
    with asyncio.Runner() as runner, contextlib.ExitStack() as closing:
        stack = contextlib.AsyncExitStack()
        closing.callback(lambda: runner.run(stack.aclose()))
        runner.run(
            ensure_topics(settings.kafka_bootstrap, [*topics.specs(), topics.reply_spec("bad")])
        )

        async def start_admission() -> Admission:
            return await stack.enter_async_context(Admission(admission_settings(settings)))

        admission = runner.run(start_admission())
        runner.run(stack.enter_async_context(capacity_feed(settings, topics, {"main": 10_000})))
        reader = runner.run(
            stack.enter_async_context(
                TopicReader(settings, topics.deadletter, topics.dispatch("main"))
            )
        )

        async def one_round(cls: Priority, bad: list[bytes | None]) -> None:
            good = inference_request(f"good-{next(counter)}", topics.reply("bad"))
            source = topics.requests(cls)
            await send_all(settings, source, [*bad, good])
            expected.update((source, raw or b"") for raw in bad)
            await reader.until(topics.deadletter, sum(expected.values()))
            dispatched = {d.request.request_id for d in reader.dispatched(topics.dispatch("main"))}
            while good.request_id not in dispatched:
                await reader.poll()
                dispatched = {
                    d.request.request_id for d in reader.dispatched(topics.dispatch("main"))
                }
            assert not admission.failed.is_set()

        @hypothesis_settings(
            max_examples=15,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        @given(st.sampled_from(list(Priority)), st.lists(bad_records, min_size=1, max_size=4))
        def check(cls: Priority, bad: list[bytes | None]) -> None:
            runner.run(asyncio.wait_for(one_round(cls, bad), timeout=30))

        check()
        letters = reader.dead_letters(topics.deadletter)
        # (an excerpt is screened: a drawn value that looks like a card number is redacted)
        assert Counter((d.source_topic, d.excerpt) for d in letters) == Counter(
            {(t, screened_excerpt(raw)): n for (t, raw), n in expected.items()}
        )
        assert all(d.size == 0 or d.sha256 for d in letters)
        assert {d.reason for d in letters} <= REASONS
        assert all(d.service.startswith("admission:") for d in letters)
        assert not admission.failed.is_set()
