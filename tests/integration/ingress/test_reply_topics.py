"""Reply topics do not outlive their owners (security issue 40, item 3), on the real
broker and Redis: a client that closes deletes its topic and no replier brings it back;
ingress deletes its own at stop; a killed owner's topic is swept once its heartbeats
stop; a live owner's never is; a sweep deletes at most its bound."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import UnknownTopicOrPartitionError
from prometheus_client import REGISTRY

from schemas import InferenceReply, ReplyStatus
from seawall_client import SeawallClient
from seawall_client.clock import SYSTEM_CLOCK, Clock, ManualClock
from seawall_client.kafka import ensure_topics, new_admin
from seawall_client.serde import encode
from seawall_client.topics import RedisKeys, Topics
from services.common.bus import make_producer
from services.common.settings import CommonSettings
from services.ingress.replies import ReplyRouter
from services.ingress.reply_sweeper import ReplyTopicSweeper
from services.ingress.service import IngressService
from tests.integration.ingress.conftest import eventually, ingress_settings

pytestmark = pytest.mark.integration


def api_key() -> str:
    return f"sk-sw-{uuid.uuid4().hex[:12]}_" + "S" * 43


@pytest.fixture
async def admin(settings: CommonSettings) -> AsyncIterator[AIOKafkaAdminClient]:
    a = new_admin(settings.kafka)
    await a.start()
    try:
        yield a
    finally:
        await a.close()


@pytest.fixture
async def replier(settings: CommonSettings) -> AsyncIterator[AIOKafkaProducer]:
    """A service's producer, as admission's or a worker's, that replies to clients."""
    p = make_producer(settings, request_timeout_ms=120_000)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def listed(admin: AIOKafkaAdminClient, topic: str) -> bool:
    return topic in set(await admin.list_topics())


def reply(request_id: str) -> bytes:
    return encode(
        InferenceReply(
            request_id=request_id, status=ReplyStatus.OK, text="hi", completed_at=time.time()
        )
    )


async def test_a_closed_client_deletes_its_topic_and_no_replier_brings_it_back(
    settings: CommonSettings,
    topics: Topics,
    admin: AIOKafkaAdminClient,
    replier: AIOKafkaProducer,
) -> None:
    client = SeawallClient(api_key=api_key(), kafka=settings.kafka)
    await client.start()
    topic = client.reply_topic
    try:
        assert await listed(admin, topic)
        # The fleet replied to it: the replier's producer now asks for its metadata at
        # every refresh (aiokafka created a deleted topic again that way).
        await replier.send_and_wait(topic, reply("r1"), key=b"r1")
    finally:
        await client.stop()
    assert not await listed(admin, topic)

    # A refresh of the replier's metadata (forced by a topic it had not written to
    # before, as a new client's reply topic does) creates nothing.
    owner = f"{uuid.uuid4().hex[:12]}.other"
    await ensure_topics(settings.kafka, [topics.reply_spec(owner)])
    other = topics.reply(owner)
    await replier.send_and_wait(other, reply("r2"), key=b"r2")
    await replier.client.force_metadata_update()
    assert not await listed(admin, topic)

    # A late reply to it fails, rather than wait for the topic for the replier's whole
    # request timeout (two minutes here; aiokafka's wait).
    async with asyncio.timeout(30):
        with pytest.raises(UnknownTopicOrPartitionError):
            await replier.send(topic, reply("r3"), key=b"r3")
    assert not await listed(admin, topic)


async def test_a_client_whose_reply_may_still_come_keeps_its_topic(
    settings: CommonSettings, topics: Topics, admin: AIOKafkaAdminClient
) -> None:
    client = SeawallClient(api_key=api_key(), kafka=settings.kafka, reply_margin_s=0)
    await client.start()
    try:
        with pytest.raises(TimeoutError):  # nobody answers: given up on, still queued
            await client.complete("hello", timeout_s=0.2)
    finally:
        await client.stop()
    assert await listed(admin, client.reply_topic)  # the sweeper's, once idle


def router_records(outcome: str) -> float:
    value = REGISTRY.get_sample_value("seawall_reply_router_records_total", {"outcome": outcome})
    return value or 0.0


async def test_ingress_skips_its_heartbeats_and_deletes_its_topic_at_stop(
    settings: CommonSettings, topics: Topics, admin: AIOKafkaAdminClient
) -> None:
    before = router_records("heartbeat"), router_records("undecodable")
    service = IngressService(ingress_settings(settings, reply_heartbeat_s=0.1, reply_idle_s=1))
    async with service:
        topic = service.router.topic
        assert await listed(admin, topic)

        async def beats_read() -> bool:
            return router_records("heartbeat") >= before[0] + 3

        await eventually(beats_read)
        assert router_records("undecodable") == before[1]  # skipped, not dead-lettered
    assert not await listed(admin, topic)


OWNER = """
import asyncio, sys
from seawall_client import SeawallClient

async def main() -> None:
    client = SeawallClient(api_key=sys.argv[1], owner="doomed", heartbeat_s=0.2)
    await client.start()
    print(client.reply_topic, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def killed_owner(settings: CommonSettings) -> str:
    """A client in a process of its own, SIGKILLed once it has started: its topic."""
    env = {
        **os.environ,
        "SEAWALL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "SEAWALL_KAFKA_IDEMPOTENCE": str(settings.kafka_idempotence).lower(),
        "SEAWALL_TOPIC_PREFIX": settings.topic_prefix,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OWNER, api_key(), env=env, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        await asyncio.sleep(0.5)  # a heartbeat or two
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    topic = line.decode().strip()
    assert topic.startswith(settings.topic_prefix + "llm.reply.")
    return topic


def sweeper(
    settings: CommonSettings,
    topics: Topics,
    redis: aioredis.Redis,
    clock: Clock = SYSTEM_CLOCK,
    **changes: float,
) -> ReplyTopicSweeper:
    # Rounds 0.3 s apart: the test's calls come a little later than the lease (0.27 s)
    # and well within three rounds (the gap after which the idle wait starts afresh).
    options: dict[str, float] = {"every_s": 0.3, "idle_s": 3.0, "max_deletions": 100}
    options.update(changes)
    return ReplyTopicSweeper(
        settings.kafka,
        topics,
        RedisKeys(settings.redis_prefix),
        redis,
        holder="test",
        every_s=options["every_s"],
        idle_s=options["idle_s"],
        max_deletions=int(options["max_deletions"]),
        clock=clock,
    )


async def test_a_killed_owners_topic_is_swept_and_live_owners_topics_never_are(
    settings: CommonSettings,
    topics: Topics,
    redis: aioredis.Redis,
    admin: AIOKafkaAdminClient,
) -> None:
    idle_s = 3.0
    sweep = sweeper(settings, topics, redis, idle_s=idle_s)
    producer = make_producer(settings)
    await producer.start()
    live_client = SeawallClient(api_key=api_key(), kafka=settings.kafka, heartbeat_s=0.2)
    live_router = ReplyRouter(settings, "ingress-live", producer=producer, heartbeat_s=0.2)
    try:
        await live_client.start()
        await live_router.start()
        live = {live_client.reply_topic, live_router.topic}
        doomed = await killed_owner(settings)
        assert await listed(admin, doomed)

        # Rounds until the killed owner's topic is gone, then as long again: the live
        # owners' topics outlast every round, however many idle times pass.
        killed_at = time.monotonic()
        swept: list[str] = []
        gone_after: float | None = None
        while gone_after is None or time.monotonic() - killed_at < 2 * gone_after:
            swept += await sweep.sweep()
            names = set(await admin.list_topics())
            assert live <= names, f"a live owner's topic was swept: {live - names}"
            if gone_after is None and doomed not in names:
                gone_after = max(time.monotonic() - killed_at, 2 * idle_s)
            assert time.monotonic() - killed_at < 60, "the killed owner's topic was never swept"
            await asyncio.sleep(0.3)
        assert swept == [doomed]
    finally:
        await live_router.stop()
        await live_client.stop()
        await producer.stop()


async def test_a_sweep_deletes_at_most_its_bound_oldest_idle_first(
    settings: CommonSettings,
    topics: Topics,
    redis: aioredis.Redis,
    admin: AIOKafkaAdminClient,
) -> None:
    owners = [f"{uuid.uuid4().hex[:12]}.gone-{i}" for i in range(3)]
    await ensure_topics(settings.kafka, [topics.reply_spec(owners[0])])
    # Idle times on the test's clock, so that a slow machine cannot age a topic early;
    # between rounds the real lease (0.27 s) runs out.
    clock = ManualClock(time.time())
    sweep = sweeper(settings, topics, redis, clock, idle_s=0.5, max_deletions=2)

    async def later(s: float) -> None:
        clock.advance(s)
        await asyncio.sleep(0.3)

    assert await sweep.sweep() == []  # first seen: the idle wait starts
    await later(0.3)
    await ensure_topics(settings.kafka, [topics.reply_spec(o) for o in owners[1:]])
    assert await sweep.sweep() == []  # the first not idle long enough; the others new
    await later(0.6)
    first = await sweep.sweep()
    assert len(first) == 2
    assert first[0] == topics.reply(owners[0])  # the longest idle first
    await later(0.3)
    second = await sweep.sweep()
    assert sorted(first + second) == sorted(topics.reply(o) for o in owners)
    names = set(await admin.list_topics())
    assert not names & {topics.reply(o) for o in owners}
    assert set(t.name for t in topics.specs()) <= names  # nothing but reply topics
