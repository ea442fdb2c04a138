"""The runtime against the real broker and the real Redis."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
import redis.asyncio as aioredis
from aiokafka import TopicPartition

from schemas import DeadLetter, InferenceRequest
from schemas.deadletter import EXCERPT_BYTES
from seawall_client.kafka import ensure_topics
from seawall_client.serde import REQUEST, DecodeError, decode, encode
from seawall_client.topics import Topics
from services.common.bus import make_consumer, make_producer
from services.common.deadletters import DeadLetters
from services.common.settings import CommonSettings


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


async def test_redis_answers_with_ttl(settings: CommonSettings, redis: aioredis.Redis) -> None:
    key = f"{settings.redis_prefix}probe"
    await redis.set(key, "1", px=5000)
    assert await redis.get(key) == b"1"
    assert 0 < await redis.pttl(key) <= 5000
    seconds, micros = await redis.time()
    assert abs(seconds + micros / 1e6 - time.time()) < 5
    await asyncio.sleep(0)
