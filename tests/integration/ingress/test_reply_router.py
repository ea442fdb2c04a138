"""The reply router on the real broker: per-request streams, duplicates dropped, bad
records dead-lettered, waiters woken when it stops."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaProducer
from prometheus_client import REGISTRY

from schemas import DeadLetter, InferenceReply, ReplyChunk, ReplyStatus
from schemas.base import Message
from seawall_client.serde import encode
from seawall_client.streams import ReplyItem, ReplyRouterClosed
from seawall_client.topics import Topics
from services.common.bus import make_consumer, make_producer
from services.common.deadletters import DeadLetters
from services.common.settings import CommonSettings
from services.ingress.replies import ReplyRouter

pytestmark = pytest.mark.integration


@pytest.fixture
async def producer(settings: CommonSettings) -> AsyncIterator[AIOKafkaProducer]:
    p = make_producer(settings)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


@pytest.fixture
async def router(
    settings: CommonSettings, topics: Topics, producer: AIOKafkaProducer
) -> AsyncIterator[ReplyRouter]:
    letters = DeadLetters(producer, topics.deadletter, "test")
    async with ReplyRouter(settings, "sdk-1", dead_letters=letters) as r:
        yield r


def chunk(rid: str, seq: int) -> ReplyChunk:
    return ReplyChunk(request_id=rid, seq=seq, text=f"t{seq}")


def terminal(rid: str, text: str = "t0t1") -> InferenceReply:
    return InferenceReply(
        request_id=rid, status=ReplyStatus.OK, text=text, chunks=2, completed_at=time.time()
    )


async def send(producer: AIOKafkaProducer, topic: str, *items: Message | bytes) -> None:
    for item in items:
        value = item if isinstance(item, bytes) else encode(item)
        await producer.send_and_wait(topic, value, key=b"k")


def count(outcome: str) -> float:
    value = REGISTRY.get_sample_value("seawall_reply_router_records_total", {"outcome": outcome})
    return value or 0.0


async def collect(items: AsyncIterator[ReplyItem]) -> list[ReplyItem]:
    async with asyncio.timeout(20):
        return [item async for item in items]


async def test_streams_get_their_replies_once_in_order(
    router: ReplyRouter, producer: AIOKafkaProducer, topics: Topics
) -> None:
    assert router.topic == topics.reply("sdk-1")
    before = {o: count(o) for o in ("delivered", "duplicate", "orphan")}
    assert not router.counts
    a = router.register("a")
    b = router.register("b")
    with pytest.raises(ValueError, match="already registered"):
        router.register("a")
    await send(
        producer,
        router.topic,
        chunk("a", 0),
        chunk("b", 0),
        chunk("a", 1),
        chunk("a", 0),  # redelivered
        terminal("a"),
        terminal("a"),  # a duplicate terminal reply
        chunk("a", 2),  # after the terminal reply
        terminal("nobody"),  # no one registered it
        terminal("b", "t0"),
    )
    got = await collect(a)
    assert [(type(i).__name__, getattr(i, "seq", None)) for i in got] == [
        ("ReplyChunk", 0),
        ("ReplyChunk", 1),
        ("InferenceReply", None),
    ]
    async with asyncio.timeout(20):
        reply = await b.result()
    assert reply.text == "t0"
    assert a.terminal is not None
    router.unregister("a")
    router.unregister("b")
    # After unregister, a late copy of a finished request is still known as a duplicate.
    await send(producer, router.topic, terminal("a"))

    deadline = time.monotonic() + 20
    while router.counts["duplicate"] < 4:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert router.counts == {"delivered": 5, "duplicate": 4, "orphan": 1}
    # The metric sums every router's tallies.
    assert {o: count(o) - before[o] for o in before} == router.counts
    assert router.waiting == 0


async def test_undecodable_replies_are_dead_lettered_and_routing_goes_on(
    router: ReplyRouter,
    producer: AIOKafkaProducer,
    settings: CommonSettings,
    topics: Topics,
) -> None:
    stream = router.register("x")
    await send(producer, router.topic, b"{oops", terminal("x"))
    async with asyncio.timeout(20):
        assert (await stream.result()).request_id == "x"
    consumer = make_consumer(settings, topics.deadletter, group_id=None)
    await consumer.start()
    try:
        letters: list[DeadLetter] = []
        deadline = time.monotonic() + 20
        while not letters and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                letters += [DeadLetter.model_validate_json(r.value) for r in records]
    finally:
        await consumer.stop()
    (letter,) = letters
    assert (letter.reason, letter.excerpt, letter.source_topic) == (
        "invalid_json",
        b"{oops",
        router.topic,
    )


async def test_stopping_wakes_every_waiter(settings: CommonSettings, topics: Topics) -> None:
    router = ReplyRouter(settings, "sdk-2")
    await router.start()
    stream = router.register("w")
    waiter = asyncio.create_task(stream.result())
    await asyncio.sleep(0.05)
    await router.stop()
    with pytest.raises(ReplyRouterClosed):
        await waiter
    with pytest.raises(ReplyRouterClosed):
        router.register("later")
