"""The Kafka ingress on the real broker and Redis: producers post onto ``llm.ingress``
with their key id and their own reply topic."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    AbortRequest,
    ClientMeta,
    DeadLetter,
    InferenceRequest,
    Priority,
    ReasonCode,
    ReplyStatus,
    SamplingParams,
    Tier,
)
from schemas.deadletter import EXCERPT_BYTES
from services.common.bus import make_consumer, make_producer
from services.common.serde import encode
from services.common.settings import CommonSettings
from services.common.topics import RedisKeys, Topics
from services.ingress.keys import key_id_of
from services.ingress.pipeline import ABORT_MARKER_MARGIN_S
from services.ingress.service import IngressService
from tests.fleet import ReplyReader, produce
from tests.integration.ingress.conftest import Downstream, Keys

pytestmark = [
    pytest.mark.integration,
    pytest.mark.parametrize(
        "ingress", [{"kafka_ingress": True, "max_output_tokens": 1000}], indirect=True
    ),
]

PRODUCER = "producer-a"


def key_id(key: str) -> str:
    kid = key_id_of(key)
    assert kid is not None
    return kid


def record(
    topics: Topics, rid: str, api_key_id: str | None, prompt: str = "hi", **fields: Any
) -> InferenceRequest:
    return InferenceRequest(
        request_id=rid,
        tenant=fields.pop("tenant", "claimed-tenant"),
        tier=fields.pop("tier", Tier.BASIC),
        priority=fields.pop("priority", Priority.BULK),
        api_key_id=api_key_id,
        prompt=prompt,
        reply_to=fields.pop("reply_to", topics.reply(PRODUCER)),
        created_at=time.time(),
        **fields,
    )


NOWHERE = "nobody-home"


def sha256(value: bytes) -> str:
    return hashlib.sha256(value).hexdigest()


async def list_topics(settings: CommonSettings) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


class DeadLetters:
    def __init__(self, settings: CommonSettings, topics: Topics) -> None:
        self._consumer: AIOKafkaConsumer = make_consumer(settings, topics.deadletter, group_id=None)
        self.letters: list[DeadLetter] = []

    async def poll(self) -> None:
        for records in (await self._consumer.getmany(timeout_ms=200)).values():
            self.letters += [DeadLetter.model_validate_json(r.value) for r in records]

    async def start(self) -> None:
        await self._consumer.start()

    async def stop(self) -> None:
        await self._consumer.stop()


@pytest.fixture
async def dead_letters(settings: CommonSettings, topics: Topics) -> AsyncIterator[DeadLetters]:
    letters = DeadLetters(settings, topics)
    await letters.start()
    try:
        yield letters
    finally:
        await letters.stop()


@pytest.fixture
async def producer_replies(settings: CommonSettings, topics: Topics) -> AsyncIterator[ReplyReader]:
    async with ReplyReader(settings, topics, owner=PRODUCER) as reader:
        yield reader


async def drain(
    predicate: Callable[[], bool], *pollers: Callable[[], Awaitable[None]], timeout_s: float = 30
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not everything arrived in time"
        for poll in pollers:
            await poll()


async def test_records_are_classified_from_the_key_not_from_the_record(
    ingress: IngressService,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    downstream: Downstream,
    producer_replies: ReplyReader,
) -> None:
    sent = [
        record(topics, "k-ent", key_id(keys.enterprise), session_id="chat-1"),
        record(
            topics,
            "k-pro",
            key_id(keys.pro),
            tier=Tier.ENTERPRISE,
            priority=Priority.VIP,
            deadline_at=time.time() + 30,
            client=ClientMeta(client_ip="203.0.113.5"),
        ),
        record(topics, "k-redact", key_id(keys.enterprise), prompt="my card 4111 1111 1111 1111"),
    ]
    await produce(settings, topics.ingress, sent)
    got = {req.request_id: (topic, key, req) for topic, key, req in await downstream.take(3)}

    topic, key, ent = got["k-ent"]
    assert topic == topics.requests(Priority.VIP)
    assert key == b"chat-1"
    assert (ent.tenant, ent.tier, ent.priority) == ("big-co", Tier.ENTERPRISE, Priority.VIP)
    assert ent.reply_to == topics.reply(PRODUCER)  # their replies go to their own topic
    assert ent.deadline_at is not None
    assert ent.deadline_at <= time.time() + 120

    topic, key, pro = got["k-pro"]
    assert topic == topics.requests(Priority.STANDARD)  # not the VIP it claimed
    assert (pro.tenant, pro.tier) == ("pro-co", Tier.PRO)
    assert key == b"pro-co"
    assert pro.deadline_at == sent[1].deadline_at  # asked for less than the default
    assert pro.client.region == "eu-west"

    assert got["k-redact"][2].prompt == "my card [REDACTED:bank_card]"
    await producer_replies.poll(300)
    assert producer_replies.terminals == {}  # admitted requests are answered downstream


async def test_bad_records_are_dead_lettered_or_rejected_and_consuming_goes_on(
    ingress: IngressService,
    keys: Keys,
    backdated: Callable[[str, float], Awaitable[str]],
    settings: CommonSettings,
    topics: Topics,
    downstream: Downstream,
    producer_replies: ReplyReader,
    dead_letters: DeadLetters,
) -> None:
    retired = await backdated("gone-co", 100)
    good = record(topics, "good", key_id(keys.pro))
    undecodable = {
        b"{not json": "invalid_json",
        b"\xff\xfe{}": "invalid_utf8",
        b'{"type": "inference_request"}': "schema_violation",
        b"[" * 5000 + b"]" * 5000: "invalid_json",
        b'{"a": ' + b"1" * 5000 + b"}": "invalid_json",
        json.dumps({**json.loads(encode(good)), "schema_version": 9}).encode(): (
            "unsupported_version"
        ),
        json.dumps(
            {**json.loads(encode(good)), "sampling": {"max_tokens": 10**9}}
        ).encode(): "schema_violation",
        encode(good).replace(
            topics.reply(PRODUCER).encode(), topics.requests(Priority.VIP).encode()
        ): "invalid_reply_to",
        # a reply topic nobody created: refused, never created by producing to it
        encode(record(topics, "nowhere", None, reply_to=topics.reply(NOWHERE))): (
            "reply_topic_unreachable"
        ),
    }
    rejected = {
        "no-key": (record(topics, "no-key", None), ReasonCode.UNAUTHENTICATED),
        "unknown": (record(topics, "unknown", "0123456789ab"), ReasonCode.UNAUTHENTICATED),
        "retired": (record(topics, "retired", key_id(retired)), ReasonCode.UNAUTHENTICATED),
        "blocked": (
            record(topics, "blocked", key_id(keys.blocking), prompt="密码: hunter22"),
            ReasonCode.SENSITIVE_DATA,
        ),
        "oversize": (
            record(topics, "oversize", key_id(keys.pro), prompt="x" * 30_000),
            ReasonCode.INVALID_REQUEST,
        ),
        "max-tokens": (
            record(
                topics, "max-tokens", key_id(keys.pro), sampling=SamplingParams(max_tokens=2000)
            ),
            ReasonCode.INVALID_REQUEST,
        ),
        "scanner": (
            record(topics, "scanner", key_id(keys.pro), client=ClientMeta(user_agent="sqlmap/1")),
            ReasonCode.FORBIDDEN,
        ),
    }
    await produce(
        settings,
        topics.ingress,
        [*undecodable, *(r for r, _ in rejected.values()), good],
    )
    ((_, _, req),) = await downstream.take(1)
    assert req.request_id == "good"

    await drain(
        lambda: (
            len(dead_letters.letters) >= len(undecodable)
            and len(producer_replies.terminals) >= len(rejected)
        ),
        dead_letters.poll,
        producer_replies.poll,
    )
    assert sorted(d.reason for d in dead_letters.letters) == sorted(undecodable.values())
    assert {d.excerpt for d in dead_letters.letters} == {u[:EXCERPT_BYTES] for u in undecodable}
    assert {d.sha256 for d in dead_letters.letters} == {sha256(u) for u in undecodable}
    assert all(d.source_topic == topics.ingress for d in dead_letters.letters)
    assert topics.reply(NOWHERE) not in await list_topics(settings)
    for rid, (_, reason) in rejected.items():
        (reply,) = producer_replies.terminals[rid]
        assert reply.status is ReplyStatus.REJECTED
        assert reply.reason is reason, rid
        assert "hunter22" not in reply.message
    await downstream.poll(300)
    assert [r.request_id for _, _, r in downstream.seen] == ["good"]
    assert ingress.kafka.running
    assert not ingress.failed.is_set()


async def test_aborts_from_live_keys_mark_their_request_others_are_dead_lettered(
    ingress: IngressService,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    redis: aioredis.Redis,
    dead_letters: DeadLetters,
) -> None:
    now = time.time()
    live = AbortRequest(
        request_id="ab-1", api_key_id=key_id(keys.pro), created_at=now, deadline_at=now + 30
    )
    unknown = AbortRequest(request_id="ab-2", api_key_id="0123456789ab", created_at=now)
    await produce(settings, topics.ingress, [unknown, live])
    await drain(lambda: len(dead_letters.letters) >= 1, dead_letters.poll)
    (letter,) = dead_letters.letters
    assert letter.reason == "invalid_api_key"
    marks = RedisKeys(settings.redis_prefix)
    deadline = time.monotonic() + 30
    while not await redis.exists(marks.abort("ab-1")):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert 30 < await redis.ttl(marks.abort("ab-1")) <= 31 + ABORT_MARKER_MARGIN_S
    assert not await redis.exists(marks.abort("ab-2"))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=10,
)


def _mutations(topics: Topics) -> st.SearchStrategy[bytes]:
    """Records a producer might get wrong: garbage, JSON of the wrong shape, a request
    with one field replaced by any JSON value."""
    base = json.loads(encode(record(topics, "base", "0123456789ab")))
    mutated = st.tuples(st.sampled_from(sorted(base)), _JSON).map(
        lambda kv: json.dumps({**base, "request_id": uuid.uuid4().hex, kv[0]: kv[1]}).encode()
    )
    return st.one_of(
        st.binary(max_size=64),
        _JSON.map(lambda v: json.dumps(v).encode()),
        mutated,
    )


@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
async def test_fuzzed_records_each_get_one_outcome(
    ingress: IngressService,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    downstream: Downstream,
    producer_replies: ReplyReader,
    dead_letters: DeadLetters,
    data: st.DataObject,
) -> None:
    bad = data.draw(st.lists(_mutations(topics), min_size=1, max_size=15))
    sentinel = record(topics, f"ok-{uuid.uuid4().hex}", key_id(keys.pro))
    letters_before = len(dead_letters.letters)
    replies_before = replies(producer_replies)
    seen_before = len(downstream.seen)
    # one key: one partition, so the sentinel is judged after every bad record
    producer_messages = [*bad, encode(sentinel)]
    await produce_one_key(settings, topics.ingress, producer_messages)
    taken = await downstream.take(seen_before + 1)
    assert taken[-1][2].request_id == sentinel.request_id

    def outcomes() -> int:
        return (
            len(dead_letters.letters) - letters_before + replies(producer_replies) - replies_before
        )

    await drain(lambda: outcomes() >= len(bad), dead_letters.poll, producer_replies.poll)
    await dead_letters.poll()
    await producer_replies.poll()
    assert outcomes() == len(bad)
    assert all(
        reply.status is ReplyStatus.REJECTED
        for replies in producer_replies.terminals.values()
        for reply in replies
    )
    assert not ingress.failed.is_set()


def replies(reader: ReplyReader) -> int:
    """Terminal replies read, duplicates of a request id included."""
    return sum(len(r) for r in reader.terminals.values())


async def produce_one_key(settings: CommonSettings, topic: str, values: list[bytes]) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, key=b"fuzz")
    finally:
        await producer.stop()
