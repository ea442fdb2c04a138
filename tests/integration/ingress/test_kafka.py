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
from prometheus_client import REGISTRY

from schemas import (
    AbortRequest,
    ClientMeta,
    DeadLetter,
    InferenceRequest,
    Priority,
    ReasonCode,
    RegionThrottle,
    ReplyStatus,
    SamplingParams,
    Tier,
)
from schemas.base import Message
from schemas.deadletter import EXCERPT_BYTES
from seawall_client import signing
from seawall_client.serde import encode
from seawall_client.signing import key_id_of
from seawall_client.topics import RedisKeys, Topics
from services.admission.service import Admission
from services.common.bus import make_consumer, make_producer
from services.common.settings import CommonSettings
from services.ingress.denials import FailureLimiter
from services.ingress.pipeline import ABORT_MARKER_MARGIN_S
from services.ingress.service import IngressService
from tests.admission_helpers import (
    TopicReader,
    admission_settings,
    apply_control,
    capacity_feed,
    control_common,
)
from tests.fleet import ReplyReader
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


def owner(key: str) -> str:
    """The producer's reply topic owner: its key's (``llm.reply.<key id>.<owner>``)."""
    return f"{key_id(key)}.{PRODUCER}"


def record(
    topics: Topics, rid: str, key: str, prompt: str = "hi", **fields: Any
) -> InferenceRequest:
    return InferenceRequest(
        request_id=rid,
        tenant=fields.pop("tenant", "claimed-tenant"),
        tier=fields.pop("tier", Tier.BASIC),
        priority=fields.pop("priority", Priority.BULK),
        api_key_id=key_id(key),
        prompt=prompt,
        reply_to=fields.pop("reply_to", topics.reply(owner(key))),
        created_at=time.time(),
        **fields,
    )


Signed = tuple[bytes, list[tuple[str, bytes]]]


def signed(message: Message | bytes, key: str, at: float | None = None) -> Signed:
    """The record's value and its signing headers (``seawall_client.signing``)."""
    value = message if isinstance(message, bytes) else encode(message)
    return value, signing.sign(key, key_id(key), value, time.time() if at is None else at)


async def produce_signed(
    settings: CommonSettings, topic: str, records: list[Signed], key: bytes | None = None
) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        for i, (value, headers) in enumerate(records):
            await producer.send_and_wait(topic, value, key=key or f"k{i}".encode(), headers=headers)
    finally:
        await producer.stop()


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
async def producer_replies(
    settings: CommonSettings, topics: Topics, keys: Keys
) -> AsyncIterator[ReplyReader]:
    """The reply topics of the producer's keys (one each)."""
    owners = [owner(k) for k in (keys.pro, keys.enterprise, keys.blocking, keys.basic)]
    async with ReplyReader(settings, topics, *owners) as reader:
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
        record(topics, "k-ent", keys.enterprise, session_id="chat-1"),
        record(
            topics,
            "k-pro",
            keys.pro,
            tier=Tier.ENTERPRISE,
            priority=Priority.VIP,
            deadline_at=time.time() + 30,
            client=ClientMeta(client_ip="203.0.113.5"),
        ),
        record(topics, "k-redact", keys.enterprise, prompt="my card 4111 1111 1111 1111"),
    ]
    await produce_signed(
        settings,
        topics.ingress,
        [signed(r, keys.enterprise if r.request_id != "k-pro" else keys.pro) for r in sent],
    )
    got = {req.request_id: (topic, key, req) for topic, key, req in await downstream.take(3)}

    topic, key, ent = got["k-ent"]
    assert topic == topics.requests(Priority.VIP)
    assert key == b"chat-1"
    assert (ent.tenant, ent.tier, ent.priority) == ("big-co", Tier.ENTERPRISE, Priority.VIP)
    assert ent.reply_to == topics.reply(owner(keys.enterprise))  # to their key's own topic
    assert ent.deadline_at is not None
    assert ent.deadline_at <= time.time() + 120

    topic, key, pro = got["k-pro"]
    assert topic == topics.requests(Priority.STANDARD)  # not the VIP it claimed
    assert (pro.tenant, pro.tier) == ("pro-co", Tier.PRO)
    assert key == b"pro-co"
    assert pro.deadline_at == sent[1].deadline_at  # asked for less than the default
    # Its client_ip is in eu-west's range, but a record's client_ip is whatever its
    # producer wrote: the region (what throttles aim at) is never the producer's choice.
    assert sent[1].client.client_ip == "203.0.113.5"
    assert pro.client.region == ""

    assert got["k-redact"][2].prompt == "my card [REDACTED:bank_card]"
    await producer_replies.poll(300)
    assert producer_replies.terminals == {}  # admitted requests are answered downstream


CLAIMED_ADDRESSES = [
    "203.0.113.5",  # eu-west's range in the region table
    "198.51.100.7",  # ap-east's
    "::ffff:203.0.113.9",
    "2001:db8::1",
    "10.0.0.1",
    "not-an-address",
    "",
]
"""What a producer may write as its record's ``client_ip``: every range of the region
table, other addresses, and none."""


async def test_a_records_region_is_its_tenants_whatever_its_client_ip_says(
    ingress: IngressService,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    downstream: Downstream,
    producer_replies: ReplyReader,
) -> None:
    """The region (what regional throttles and hotspot detection aim at) of a Kafka
    request is its tenant's, set by the operator in its signed policy; the client_ip
    and region a producer wrote in its record change nothing."""
    policy = await ingress.keystore.set_policy("pro-co", region="ap-east")
    assert policy.region == "ap-east"
    sent: list[tuple[InferenceRequest, str]] = []
    for i, address in enumerate(CLAIMED_ADDRESSES):
        claimed = ClientMeta(client_ip=address, region="eu-west" if i % 2 else "")
        sent.append((record(topics, f"reg-pro-{i}", keys.pro, client=claimed), keys.pro))
        # a tenant with no region: its Kafka requests come from none, wherever they claim
        other = record(topics, f"reg-ent-{i}", keys.enterprise, client=claimed)
        sent.append((other, keys.enterprise))
    await produce_signed(settings, topics.ingress, [signed(r, k) for r, k in sent])
    got = {req.request_id: req for _, _, req in await downstream.take(len(sent))}
    assert set(got) == {r.request_id for r, _ in sent}
    await producer_replies.poll(300)
    assert producer_replies.terminals == {}  # none refused: all went on to admission
    for i, address in enumerate(CLAIMED_ADDRESSES):
        assert got[f"reg-pro-{i}"].client.region == "ap-east", address
        assert got[f"reg-ent-{i}"].client.region == "", address
        assert got[f"reg-pro-{i}"].client.client_ip == address  # carried, never believed


async def test_a_region_throttle_holds_back_its_tenants_kafka_requests(
    ingress: IngressService,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    producer_replies: ReplyReader,
) -> None:
    """A throttle the controller (here: a signed control event) issues for a region
    applies to the Kafka requests of the tenants the operator placed there, whatever
    address their records claim; a tenant elsewhere passes, even claiming an address in
    the throttled region's range."""
    await ingress.keystore.set_policy("pro-co", region="ap-east")
    admission = Admission(admission_settings(settings))
    async with (
        admission,
        TopicReader(settings, topics.dispatch("main")) as dispatched,
        capacity_feed(settings, topics, {"main": 100}),
    ):
        stop = RegionThrottle(**control_common("region:ap-east", 1), region="ap-east", rate_per_s=0)
        await apply_control(settings, topics, admission.control, stop)
        eu = ClientMeta(client_ip="203.0.113.5")  # eu-west's range: no dodging the throttle
        ap = ClientMeta(client_ip="198.51.100.7")  # ap-east's range: no aiming it at others
        sent = [
            (record(topics, "thr-pro", keys.pro, client=eu), keys.pro),
            (record(topics, "thr-ent", keys.enterprise, client=ap), keys.enterprise),
        ]
        await produce_signed(settings, topics.ingress, [signed(r, k) for r, k in sent])
        await drain(
            lambda: "thr-pro" in producer_replies.terminals,
            producer_replies.poll,
        )
        await dispatched.until(topics.dispatch("main"), 1)
    (reply,) = producer_replies.terminals["thr-pro"]
    assert (reply.status, reply.reason) == (ReplyStatus.REJECTED, ReasonCode.REGION_THROTTLED)
    assert [d.request.request_id for d in dispatched.dispatched(topics.dispatch("main"))] == [
        "thr-ent"
    ]
    assert "thr-ent" not in producer_replies.terminals


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
    good = record(topics, "good", keys.pro)
    pro = keys.pro
    # signed by the pro key, unusable all the same: dead-lettered, with the reason
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
        # over the one request limit: refused on its size, before its JSON is read
        encode(record(topics, "oversize", pro, prompt="x" * 30_000)): "too_large",
        b"{" + b"x" * 20_000: "too_large",
        # its key's reply topic, which nobody created: never created by producing to it
        encode(record(topics, "nowhere", pro, reply_to=topics.reply(f"{key_id(pro)}.{NOWHERE}"))): (
            "reply_topic_unreachable"
        ),
    }
    rejected = {
        "retired": (record(topics, "retired", retired), retired, ReasonCode.UNAUTHENTICATED),
        "blocked": (
            record(topics, "blocked", keys.blocking, prompt="密码: hunter22"),
            keys.blocking,
            ReasonCode.SENSITIVE_DATA,
        ),
        "max-tokens": (
            record(topics, "max-tokens", pro, sampling=SamplingParams(max_tokens=2000)),
            pro,
            ReasonCode.INVALID_REQUEST,
        ),
        "scanner": (
            record(topics, "scanner", pro, client=ClientMeta(user_agent="sqlmap/1")),
            pro,
            ReasonCode.FORBIDDEN,
        ),
    }
    async with ReplyReader(settings, topics, owner(retired)) as retired_replies:
        await produce_signed(
            settings,
            topics.ingress,
            [
                *(signed(u, pro) for u in undecodable),
                *(signed(r, k) for r, k, _ in rejected.values()),
                signed(good, pro),
            ],
        )
        ((_, _, req),) = await downstream.take(1)
        assert req.request_id == "good"

        await drain(
            lambda: (
                len(dead_letters.letters) >= len(undecodable)
                and len(producer_replies.terminals) + len(retired_replies.terminals)
                >= len(rejected)
            ),
            dead_letters.poll,
            producer_replies.poll,
            retired_replies.poll,
        )
    assert sorted(d.reason for d in dead_letters.letters) == sorted(undecodable.values())
    assert {d.excerpt for d in dead_letters.letters} == {u[:EXCERPT_BYTES] for u in undecodable}
    assert {d.sha256 for d in dead_letters.letters} == {sha256(u) for u in undecodable}
    assert all(d.source_topic == topics.ingress for d in dead_letters.letters)
    assert topics.reply(f"{key_id(pro)}.{NOWHERE}") not in await list_topics(settings)
    terminals = producer_replies.terminals | retired_replies.terminals
    for rid, (_, _, reason) in rejected.items():
        (reply,) = terminals[rid]
        assert reply.status is ReplyStatus.REJECTED
        assert reply.reason is reason, rid
        assert "hunter22" not in reply.message
    await downstream.poll(300)
    assert [r.request_id for _, _, r in downstream.seen] == ["good"]
    assert ingress.kafka is not None
    assert ingress.kafka.running
    assert not ingress.failed.is_set()


def sampled_out() -> float:
    return sum(
        s.value
        for metric in REGISTRY.collect()
        if metric.name == "seawall_ingress_requests"
        for s in metric.samples
        if s.name.endswith("_total") and s.labels.get("outcome") == "dead_letter_sampled_out"
    )


async def test_a_flood_of_records_proving_no_key_is_counted_not_kept(
    ingress: IngressService,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    downstream: Downstream,
    dead_letters: DeadLetters,
    producer_replies: ReplyReader,
) -> None:
    """Anyone who can write the topic can send unsigned records by the million: five
    become dead letters (the sample), the rest are counted and dropped, and a signed
    request behind them is served as usual."""
    assert ingress.kafka is not None
    # A sample of 5, refilled once an hour: the test does not depend on this machine's speed.
    ingress.kafka.anonymous = FailureLimiter(1 / 3600, 5)
    before = sampled_out()
    flood: list[Signed] = [(encode(record(topics, f"flood-{i}", keys.pro)), []) for i in range(30)]
    good = signed(record(topics, "ok", keys.pro), keys.pro)
    await produce_signed(settings, topics.ingress, [*flood, good])
    ((_, _, served),) = await downstream.take(1)
    assert served.request_id == "ok"
    await drain(lambda: sampled_out() - before >= 25, dead_letters.poll)
    for _ in range(5):
        await dead_letters.poll()
    assert [d.reason for d in dead_letters.letters] == ["unsigned"] * 5
    assert sampled_out() - before == 25


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
    unsigned = AbortRequest(request_id="ab-2", api_key_id=key_id(keys.pro), created_at=now)
    await produce_signed(settings, topics.ingress, [(encode(unsigned), []), signed(live, keys.pro)])
    await drain(lambda: len(dead_letters.letters) >= 1, dead_letters.poll)
    (letter,) = dead_letters.letters
    assert letter.reason == "unsigned"
    marks = RedisKeys(settings.redis_prefix)
    deadline = time.monotonic() + 30
    while not await redis.exists(marks.abort("pro-co", "ab-1")):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert 30 < await redis.ttl(marks.abort("pro-co", "ab-1")) <= 31 + ABORT_MARKER_MARGIN_S
    assert not await redis.exists(marks.abort("pro-co", "ab-2"))

    # Hostile aborts from the same live key: a deadline 73 years out, causes of its own
    # choosing. Each marker lives no longer than any request may (the ingress deadline
    # cap), and no cause becomes a metric series of its own.
    cap = ingress.settings.default_deadline_s
    hostile = [
        AbortRequest(
            request_id=f"ab-h{i}",
            api_key_id=key_id(keys.pro),
            created_at=now,
            deadline_at=now + 73 * 365 * 86_400,
            cause=f"made_up_{'x' * i}",
        )
        for i in range(5)
    ]
    await produce_signed(settings, topics.ingress, [signed(a, keys.pro) for a in hostile])
    last = marks.abort("pro-co", "ab-h4")
    while not await redis.exists(last):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    for a in hostile:
        ttl = await redis.ttl(marks.abort("pro-co", a.request_id))
        assert 0 < ttl <= cap + ABORT_MARKER_MARGIN_S + 1
    series = {
        s.labels["cause"]
        for metric in REGISTRY.collect()
        if metric.name == "seawall_ingress_aborts"
        for s in metric.samples
    }
    assert not any(c.startswith("made_up") for c in series)
    assert "other" in series


def aborts_refused() -> float:
    return sum(
        s.value
        for metric in REGISTRY.collect()
        if metric.name == "seawall_ingress_aborts_refused"
        for s in metric.samples
        if s.name.endswith("_total")
    )


async def test_a_flood_of_aborts_from_one_key_sets_only_its_budget_of_markers(
    ingress: IngressService,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    redis: aioredis.Redis,
    dead_letters: DeadLetters,
) -> None:
    """One key sends 200 signed aborts: its budget's worth (5) set markers; the other
    195 are refused — counted, a sample of 3 dead-lettered as ``too_many_aborts``, the
    rest counted as sampled out — and consuming goes on. Another key's aborts are not
    touched by that flood, nor by replays of one of its own aborts (anyone who can
    write the topic can replay a record; only a first sighting spends the budget)."""
    kafka = ingress.kafka
    assert kafka is not None
    # Wired from the settings; then a budget refilled once an hour, so that the test
    # does not depend on this machine's speed.
    assert (kafka.aborts.rate_per_s, kafka.aborts.burst) == (
        ingress.settings.kafka_aborts_per_key_per_s,
        ingress.settings.kafka_aborts_per_key_burst,
    )
    kafka.aborts = FailureLimiter(1 / 3600, 5)
    kafka.anonymous = FailureLimiter(1 / 3600, 3)
    refused_before, sampled_before = aborts_refused(), sampled_out()
    now = time.time()

    def abort(key: str, rid: str) -> Signed:
        msg = AbortRequest(
            request_id=rid, api_key_id=key_id(key), created_at=now, deadline_at=now + 30
        )
        return signed(msg, key)

    flood = [abort(keys.pro, f"flood-{i}") for i in range(200)]
    replayed = abort(keys.enterprise, "ent-0")
    others = [replayed] * 6 + [abort(keys.enterprise, f"ent-{i}") for i in range(1, 5)]
    await produce_signed(settings, topics.ingress, [*flood, *others])

    await drain(
        lambda: (
            aborts_refused() - refused_before >= 195
            and sampled_out() - sampled_before >= 192
            and len(dead_letters.letters) >= 3 + 5
        ),
        dead_letters.poll,
    )
    marks = RedisKeys(settings.redis_prefix)
    ent = [marks.abort("big-co", f"ent-{i}") for i in range(5)]
    deadline = time.monotonic() + 30
    while await redis.exists(*ent) < len(ent):
        assert time.monotonic() < deadline, "the other key's aborts were not all applied"
        await asyncio.sleep(0.05)
    marked = await redis.exists(*(marks.abort("pro-co", f"flood-{i}") for i in range(200)))
    assert marked == 5
    await dead_letters.poll()
    assert (
        sorted(d.reason for d in dead_letters.letters) == ["replayed"] * 5 + ["too_many_aborts"] * 3
    )
    assert aborts_refused() - refused_before == 195
    assert sampled_out() - sampled_before == 192
    assert kafka.running
    assert not ingress.failed.is_set()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=10,
)


def _mutations(topics: Topics, key: str) -> st.SearchStrategy[bytes]:
    """Records a producer might get wrong (signed all the same): garbage, JSON of the
    wrong shape, a request with one field replaced by any JSON value."""
    base = json.loads(encode(record(topics, "base", key)))
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
    bad = data.draw(st.lists(_mutations(topics, keys.pro), min_size=1, max_size=15))
    sentinel = record(topics, f"ok-{uuid.uuid4().hex}", keys.pro)
    letters_before = len(dead_letters.letters)
    replies_before = replies(producer_replies)
    seen_before = len(downstream.seen)
    # one key: one ingress partition, so the sentinel is judged after every bad record
    # (forwarded records may reach the priority topics in any order: sessions are keys)
    producer_messages = [signed(b, keys.pro) for b in [*bad, encode(sentinel)]]
    await produce_signed(settings, topics.ingress, producer_messages, key=b"fuzz")
    await drain(
        lambda: any(r.request_id == sentinel.request_id for _, _, r in downstream.seen),
        downstream.poll,
    )

    def outcomes() -> int:
        """Dead letters, replies, and mutations that are still a valid request (one
        field replaced by a value it may take): forwarded like any other."""
        forwarded = sum(
            1 for _, _, r in downstream.seen[seen_before:] if r.request_id != sentinel.request_id
        )
        letters = len(dead_letters.letters) - letters_before
        return letters + replies(producer_replies) - replies_before + forwarded

    pollers = (dead_letters.poll, producer_replies.poll, downstream.poll)
    await drain(lambda: outcomes() >= len(bad), *pollers)
    for poll in pollers:
        await poll()
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
