"""The runtime against the real broker and the real Redis."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
import redis.asyncio as aioredis
from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError, ProducerClosed
from aiokafka.protocol.fetch import FetchRequest

from schemas import DeadLetter, InferenceRequest
from schemas.deadletter import EXCERPT_BYTES
from seawall_client.fetch_pacing import BUSY_WINDOW_S
from seawall_client.kafka import MAX_BATCH_BYTES, ensure_topics
from seawall_client.serde import REQUEST, DecodeError, decode, encode
from seawall_client.topics import Topics
from services.common.bus import Outgoing, make_consumer, make_producer, send_batched
from services.common.deadletters import DeadLetters
from services.common.settings import CommonSettings

BIG = b"x" * (MAX_BATCH_BYTES + 10_000)
"""A record larger than a producer's batch: it travels alone in one."""


def _request(i: int, reply_to: str) -> InferenceRequest:
    return InferenceRequest(
        request_id=f"r{i}", tenant="acme", prompt=f"p{i}", reply_to=reply_to, created_at=time.time()
    )


async def _consume(consumer: object, n: int, timeout_s: float = 20) -> list[object]:
    got: list[object] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        batches = await consumer.getmany(timeout_ms=500)  # type: ignore[attr-defined]
        for records in batches.values():
            got.extend(records)
    return got


async def test_group_consumer_resumes_after_committed_offsets(
    settings: CommonSettings, topics: Topics
) -> None:
    topic = topics.ingress
    producer = make_producer(settings)
    await producer.start()
    try:
        for i in range(10):
            await producer.send_and_wait(topic, encode(_request(i, "rep")), key=f"s{i}".encode())
    finally:
        await producer.stop()

    group = f"{settings.topic_prefix}group"
    first = make_consumer(settings, topic, group_id=group)
    await first.start()
    try:
        records = await _consume(first, 10)
        assert sorted(decode(REQUEST, r.value).request_id for r in records) == sorted(
            f"r{i}" for i in range(10)
        )  # type: ignore[attr-defined]
        # Commit only what was "done": everything but the last record of each partition.
        commits = {}
        for r in records:
            tp = TopicPartition(r.topic, r.partition)  # type: ignore[attr-defined]
            commits[tp] = max(commits.get(tp, 0), r.offset)  # type: ignore[attr-defined]
        await first.commit(commits)  # next offset = last offset: the last record stays uncommitted
    finally:
        await first.stop()

    second = make_consumer(settings, topic, group_id=group)
    await second.start()
    try:
        again = await _consume(second, len(commits), timeout_s=20)
        redelivered = {(r.partition, r.offset) for r in again}  # type: ignore[attr-defined]
        assert redelivered == {(tp.partition, off) for tp, off in commits.items()}
    finally:
        await second.stop()


async def test_topic_creation_is_idempotent(settings: CommonSettings, topics: Topics) -> None:
    assert await ensure_topics(settings.kafka_bootstrap, topics.specs()) == []


async def test_a_dead_letter_of_a_record_larger_than_the_producer_takes_is_sent(
    settings: CommonSettings, topics: Topics
) -> None:
    """The letter of a 900 KB record (under the broker's 1 MB limit; a whole copy with
    the letter's envelope and base64 would be over the producer's) is an excerpt."""
    producer = make_producer(settings)
    await producer.start()
    raw = b"\xff" + b"x" * 900_000
    try:
        with pytest.raises(DecodeError) as decoded:
            decode(REQUEST, raw)
        letters = DeadLetters(producer, topics.deadletter, "test")
        await letters.send(
            source_topic=topics.ingress,
            partition=1,
            offset=42,
            key=b"k",
            value=raw,
            reason=decoded.value.reason,
            error=decoded.value.message,
        )
    finally:
        await producer.stop()
    consumer = make_consumer(settings, topics.deadletter, group_id=None)
    await consumer.start()
    try:
        (record,) = await _consume(consumer, 1)
        letter = DeadLetter.model_validate_json(record.value)  # type: ignore[attr-defined]
        assert (letter.reason, letter.offset, letter.key, letter.size) == (
            "invalid_utf8",
            42,
            b"k",
            len(raw),
        )
        assert letter.excerpt == raw[:EXCERPT_BYTES]
        assert letter.sha256 == hashlib.sha256(raw).hexdigest()
    finally:
        await consumer.stop()


async def test_batched_records_arrive_in_order_on_the_partition_their_key_picks(
    settings: CommonSettings, topics: Topics
) -> None:
    topic = topics.dispatch("main")
    keyed = [
        Outgoing(topic, f"k{i}-{n}".encode(), f"k{i}".encode()) for n in range(40) for i in range(7)
    ]
    placed = [Outgoing(topic, f"p-{n}".encode(), b"ignored", partition=2) for n in range(30)]
    big = Outgoing(topic, BIG, b"big", partition=1)
    producer = make_producer(settings)
    await producer.start()
    try:
        records = [*keyed[:100], big, *placed, *keyed[100:]]
        acks = await send_batched(producer, records)
        assert len(acks) == len(records)
        await asyncio.gather(*acks)
        # aiokafka's own partitioner, for comparison: the same key, the same partition.
        expected = {}
        for i in range(7):
            meta = await (await producer.send(topics.dispatch("small"), b"-", key=f"k{i}".encode()))
            expected[f"k{i}".encode()] = meta.partition
    finally:
        await producer.stop()
    consumer = make_consumer(settings, topic, group_id=None)
    await consumer.start()
    try:
        got = await _consume(consumer, len(records))
    finally:
        await consumer.stop()
    assert len(got) == len(records)
    by_partition: dict[int, list[bytes]] = {}
    for r in got:
        by_partition.setdefault(r.partition, []).append(r.value)  # type: ignore[attr-defined]
        if r.key in expected:  # type: ignore[attr-defined]
            assert r.partition == expected[r.key]  # type: ignore[attr-defined]
    assert [v for v in by_partition[2] if v.startswith(b"p-")] == [
        f"p-{n}".encode() for n in range(30)
    ]
    assert BIG in by_partition[1]
    for i in range(7):
        mine = [v for vs in by_partition.values() for v in vs if v.startswith(f"k{i}-".encode())]
        assert mine == [f"k{i}-{n}".encode() for n in range(40)]  # in order


async def test_a_batch_the_producer_does_not_take_fails_its_records_without_raising(
    settings: CommonSettings, topics: Topics
) -> None:
    producer = make_producer(settings)
    await producer.start()
    await producer.stop()  # a stopped producer takes nothing
    records = [Outgoing(topics.dispatch("main"), b"v", b"k", partition=0)] * 3
    acks = await send_batched(producer, records)
    assert len(acks) == 3
    for ack in acks:
        with pytest.raises(ProducerClosed):
            await ack


async def test_a_topic_whose_partitions_cannot_be_had_is_asked_once_per_call(
    settings: CommonSettings, topics: Topics
) -> None:
    producer = make_producer(settings)
    await producer.start()
    asked: list[str] = []

    async def no_metadata(topic: str) -> set[int]:
        # The broker's metadata out of reach (played: the producer would wait for it
        # up to its request timeout each time it is asked).
        asked.append(topic)
        raise KafkaTimeoutError()

    real = producer.partitions_for
    producer.partitions_for = no_metadata  # type: ignore[method-assign]
    try:
        keyed = [Outgoing(topics.dispatch("main"), b"v", f"k{i}".encode()) for i in range(5)]
        placed = Outgoing(topics.dispatch("main"), b"placed", b"k", partition=0)
        acks = await send_batched(producer, [*keyed, placed])
        assert asked == [topics.dispatch("main")]
        for ack in acks[:5]:
            with pytest.raises(KafkaTimeoutError):
                await ack
        await acks[5]  # a record with its partition goes out all the same
    finally:
        producer.partitions_for = real  # type: ignore[method-assign]
        await producer.stop()


async def test_redis_answers_with_ttl(settings: CommonSettings, redis: aioredis.Redis) -> None:
    key = f"{settings.redis_prefix}probe"
    await redis.set(key, "1", px=5000)
    assert await redis.get(key) == b"1"
    assert 0 < await redis.pttl(key) <= 5000
    seconds, micros = await redis.time()
    assert abs(seconds + micros / 1e6 - time.time()) < 5
    await asyncio.sleep(0)


async def test_a_paced_consumer_fetches_with_the_busy_wait_while_records_flow(
    settings: CommonSettings, topics: Topics
) -> None:
    paced = settings.model_copy(
        update={"consumer_fetch_max_wait_ms": 200, "consumer_fetch_busy_wait_ms": 7}
    )
    topic = topics.ingress
    consumer = make_consumer(paced, topic, group_id=None)
    await consumer.start()
    waits: list[int] = []
    send = consumer._client.send

    async def recording(node_id: int, request: object, **kwargs: object) -> object:
        if isinstance(request, FetchRequest):
            waits.append(request._max_wait_ms)
        return await send(node_id, request, **kwargs)

    consumer._client.send = recording
    producer = make_producer(settings)
    await producer.start()
    try:
        await consumer.getmany(timeout_ms=300)  # idle: nothing on the topic yet
        assert waits
        assert set(waits) == {200}
        await producer.send_and_wait(topic, b"x", key=b"k")
        assert len(await _consume(consumer, 1)) == 1
        waits.clear()
        await consumer.getmany(timeout_ms=300)  # within the busy window
        assert waits
        assert set(waits) == {7}
        await asyncio.sleep(BUSY_WINDOW_S)
        await consumer.getmany(timeout_ms=0)  # idle again: the window has passed
        waits.clear()
        await consumer.getmany(timeout_ms=450)
        assert waits
        assert set(waits) == {200}
    finally:
        await producer.stop()
        await consumer.stop()


async def test_a_consumer_without_a_busy_wait_keeps_its_fetch_wait(
    settings: CommonSettings, topics: Topics
) -> None:
    consumer = make_consumer(settings, topics.ingress, group_id=None, fetch_max_wait_ms=30)
    await consumer.start()
    producer = make_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(topics.ingress, b"x", key=b"k")
        assert len(await _consume(consumer, 1)) == 1
        assert consumer._fetcher._fetch_max_wait_ms == 30
    finally:
        await producer.stop()
        await consumer.stop()
