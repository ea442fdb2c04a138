"""Records on the ingress topic prove their key (issue 13), on the real broker: unsigned,
signed with another key, tampered with, replayed, stale, or naming another key's reply
topic — each refused and dead-lettered with its reason, none served, nothing reaching
the other tenant; another tenant cannot abort a request by naming its id; the SDK's
records and records built from the README's recipe with another Kafka client (no
seawall code) are served."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from schemas import AbortRequest, DeadLetter, InferenceRequest, ReplyStatus
from seawall_client import SeawallClient, signing
from seawall_client.serde import encode
from seawall_client.signing import key_id_of
from seawall_client.topics import RedisKeys, Topics
from services.common.bus import make_consumer, make_producer
from services.common.settings import CommonSettings
from services.ingress.service import IngressService
from tests.fleet import ReplyReader
from tests.integration.ingress.conftest import Downstream, Keys

pytestmark = [
    pytest.mark.integration,
    pytest.mark.parametrize("ingress", [{"kafka_ingress": True}], indirect=True),
]


def kid(key: str) -> str:
    found = key_id_of(key)
    assert found is not None
    return found


def request(topics: Topics, rid: str, key: str, **fields: object) -> InferenceRequest:
    now = time.time()
    return InferenceRequest.model_validate(
        {
            "request_id": rid,
            "tenant": "claimed",
            "api_key_id": kid(key),
            "prompt": "hello",
            "reply_to": topics.reply(f"{kid(key)}.app"),
            "created_at": now,
            "deadline_at": now + 60,
            **fields,
        }
    )


Record = tuple[bytes, list[tuple[str, bytes]]]


async def produce(settings: CommonSettings, topics: Topics, *records: Record) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        for value, headers in records:
            await producer.send_and_wait(topics.ingress, value, key=b"k", headers=headers)
    finally:
        await producer.stop()


class Letters:
    def __init__(self, settings: CommonSettings, topics: Topics) -> None:
        self._consumer = make_consumer(settings, topics.deadletter, group_id=None)
        self.letters: list[DeadLetter] = []

    async def poll(self) -> None:
        for records in (await self._consumer.getmany(timeout_ms=200)).values():
            self.letters += [DeadLetter.model_validate_json(r.value) for r in records]


@pytest.fixture
async def letters(settings: CommonSettings, topics: Topics) -> AsyncIterator[Letters]:
    reader = Letters(settings, topics)
    await reader._consumer.start()
    try:
        yield reader
    finally:
        await reader._consumer.stop()


async def until(
    predicate: Callable[[], bool], *pollers: Callable[[], Awaitable[None]], timeout_s: float = 30
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not in time"
        for poll in pollers:
            await poll()


async def test_records_that_do_not_prove_their_key_are_refused_and_reach_nobody(
    ingress: IngressService,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    downstream: Downstream,
    letters: Letters,
) -> None:
    victim, attacker = keys.enterprise, keys.basic
    now = time.time()
    cases: dict[str, Record] = {}
    r = request(topics, "unsigned", victim)
    cases["unsigned"] = (encode(r), [])
    # the victim's key id in the headers and the body, the attacker's key behind them
    r = request(topics, "wrong-key", victim)
    value = encode(r)
    forged = signing.signature(signing.signing_key(attacker), kid(victim), int(now), value)
    cases["bad_signature"] = (
        value,
        [
            (signing.HEADER_KEY_ID, kid(victim).encode()),
            (signing.HEADER_TIMESTAMP, str(int(now)).encode()),
            (signing.HEADER_SIGNATURE, forged.encode()),
        ],
    )
    # signed, then changed: another tier claimed, a longer answer asked for
    r = request(topics, "tampered", victim)
    headers = signing.sign(victim, kid(victim), encode(r), now)
    longer = r.sampling.model_copy(update={"max_tokens": 4000})
    tampered = encode(r.model_copy(update={"sampling": longer}))
    cases["bad_signature "] = (tampered, headers)
    r = request(topics, "stale", victim)
    cases["stale_timestamp"] = (encode(r), signing.sign(victim, kid(victim), encode(r), now - 3600))
    # a valid signature by the attacker, replies sent into the victim's topic
    r = request(topics, "foreign", attacker, reply_to=topics.reply(f"{kid(victim)}.app"))
    cases["foreign_reply_to"] = (encode(r), signing.sign(attacker, kid(attacker), encode(r), now))
    # the attacker's signature, the victim's key id in the body
    r = request(topics, "mismatch", attacker, api_key_id=kid(victim))
    cases["key_mismatch"] = (encode(r), signing.sign(attacker, kid(attacker), encode(r), now))

    async with ReplyReader(settings, topics, f"{kid(victim)}.app") as victim_replies:
        await produce(settings, topics, *cases.values())
        await until(lambda: len(letters.letters) >= len(cases), letters.poll)
        await asyncio.sleep(1)
        await victim_replies.poll(500)
        await downstream.poll(500)
    assert sorted(lt.reason for lt in letters.letters) == sorted(c.strip() for c in cases)
    assert all(lt.source_topic == topics.ingress for lt in letters.letters)
    assert downstream.seen == []  # none served
    assert victim_replies.terminals == {}  # nothing reached the victim's topic


async def test_a_replay_is_refused_and_a_redelivery_is_not(
    ingress: IngressService,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    downstream: Downstream,
    letters: Letters,
) -> None:
    key = keys.pro
    r = request(topics, f"once-{uuid.uuid4().hex[:6]}", key)
    value = encode(r)
    headers = signing.sign(key, kid(key), value, time.time())
    async with ReplyReader(settings, topics, f"{kid(key)}.app"):  # the producer's topic
        await produce(settings, topics, (value, headers), (value, headers))  # sent twice
        ((_, _, served),) = await downstream.take(1)
    assert served.request_id == r.request_id
    await until(lambda: len(letters.letters) >= 1, letters.poll)
    (letter,) = letters.letters
    assert letter.reason == "replayed"
    await downstream.poll(500)
    assert len(downstream.seen) == 1


async def test_nobody_aborts_another_tenants_request(
    ingress: IngressService,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    redis: aioredis.Redis,
) -> None:
    now = time.time()
    rid = "theirs-1"
    abort = AbortRequest(request_id=rid, api_key_id=kid(keys.basic), created_at=now)
    value = encode(abort)
    await produce(settings, topics, (value, signing.sign(keys.basic, kid(keys.basic), value, now)))
    marks = RedisKeys(settings.redis_prefix)
    deadline = time.monotonic() + 20
    while not await redis.exists(marks.abort("basic-co", rid)):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    # The marker is the attacker's own tenant's: the victim's request of that id is untouched.
    assert not await redis.exists(marks.abort("big-co", rid))


async def test_a_record_built_from_the_recipe_with_another_kafka_client_is_served(
    ingress: IngressService,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    downstream: Downstream,
) -> None:
    """The README's recipe, followed with confluent-kafka (librdkafka) and the standard
    library only — no seawall code signs this record."""
    import confluent_kafka  # a dev dependency: the test never skips

    key = keys.pro
    key_id = key.removeprefix("sk-sw-").split("_", 1)[0]
    timestamp = int(time.time())
    body = json.dumps(
        {
            "request_id": "from-the-recipe",
            "tenant": "anything",
            "api_key_id": key_id,
            "prompt": "hello from another client",
            "reply_to": f"{topics.prefix}llm.reply.{key_id}.other-client",
            "created_at": time.time(),
        }
    ).encode()
    signing_key = hmac.new(key.encode(), b"seawall-record-signing-v1", hashlib.sha256).digest()
    canonical = f"seawall-record-v1\n{timestamp}\n{key_id}\n{hashlib.sha256(body).hexdigest()}"
    mac = hmac.new(signing_key, canonical.encode(), hashlib.sha256).hexdigest()
    # (the reply topic is the producer's to create, before it sends)
    async with ReplyReader(settings, topics, f"{key_id}.other-client"):
        producer = confluent_kafka.Producer({"bootstrap.servers": settings.kafka_bootstrap})
        producer.produce(
            topics.ingress,
            value=body,
            key=b"other",
            headers=[
                ("seawall-key-id", key_id.encode()),
                ("seawall-timestamp", str(timestamp).encode()),
                ("seawall-signature", f"v1={mac}".encode()),
            ],
        )
        assert producer.flush(15) == 0
        ((_, _, served),) = await downstream.take(1)
    assert served.request_id == "from-the-recipe"
    assert served.tenant == "pro-co"


async def test_the_sdk_signs_transparently(
    ingress: IngressService, keys: Keys, settings: CommonSettings, downstream: Downstream
) -> None:
    async with SeawallClient(api_key=keys.pro, kafka=settings.kafka, timeout_s=20) as client:
        call = asyncio.create_task(client.complete("hi", max_tokens=4))
        ((_, _, served),) = await downstream.take(1)
        await downstream.answer(served, "hello")
        reply = await call
    assert (reply.status, reply.text) == (ReplyStatus.OK, "hello")
    assert served.tenant == "pro-co"
    assert client.reply_topic.split("llm.reply.")[1].startswith(kid(keys.pro) + ".")
