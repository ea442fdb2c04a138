"""The runtime against the real broker and the real Redis."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from aiokafka import TopicPartition

from schemas import DeadLetter, InferenceRequest
from services.common.bus import ensure_topics, make_consumer, make_producer, send_dead_letter
from services.common.serde import REQUEST, DecodeError, decode, encode
from services.common.settings import CommonSettings
from services.common.topics import Topics


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


async def test_dead_letters_keep_the_raw_record(settings: CommonSettings, topics: Topics) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        raw = b"\xff not json"
        try:
            decode(REQUEST, raw)
        except DecodeError as e:
            await send_dead_letter(
                producer,
                topics,
                source_topic=topics.ingress,
                partition=1,
                offset=42,
                key=b"k",
                raw=raw,
                error=e,
                service="test",
            )
    finally:
        await producer.stop()
    consumer = make_consumer(settings, topics.deadletter, group_id=None)
    await consumer.start()
    try:
        (record,) = await _consume(consumer, 1)
        letter = DeadLetter.model_validate_json(record.value)  # type: ignore[attr-defined]
        assert (letter.raw, letter.reason, letter.offset, letter.key) == (
            raw,
            "invalid_utf8",
            42,
            b"k",
        )
    finally:
        await consumer.stop()


async def test_redis_answers_with_ttl(settings: CommonSettings, redis: aioredis.Redis) -> None:
    key = f"{settings.redis_prefix}probe"
    await redis.set(key, "1", px=5000)
    assert await redis.get(key) == b"1"
    assert 0 < await redis.pttl(key) <= 5000
    seconds, micros = await redis.time()
    assert abs(seconds + micros / 1e6 - time.time()) < 5
    await asyncio.sleep(0)
