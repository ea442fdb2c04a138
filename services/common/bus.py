"""The services' Kafka plumbing: producer and consumer factories from their settings,
waiting for the broker, commits. What the client shares with them (the producer itself,
topic creation, tails, a bounded close) is ``seawall_client.kafka``.

Consumers never auto-commit: services commit an offset only after its effect is durable
(at-least-once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.partitioner import DefaultPartitioner

from seawall_client.fetch_pacing import Dormancy
from seawall_client.kafka import (
    Consumer,
    KafkaConfig,
    as_config,
    new_admin,
    new_consumer,
    new_producer,
)
from seawall_client.topics import Topics
from services.common.doorbell import Doorbell
from services.common.offsets import OffsetTracker
from services.common.settings import CommonSettings

log = logging.getLogger(__name__)

COMMIT_TIMEOUT_S: Final = 10.0
"""How long a commit may wait (for the group's coordinator, then for its answer)."""


def topics_of(settings: CommonSettings) -> Topics:
    return Topics(settings.topic_prefix, settings.topic_partitions, settings.pools)


def doorbell_for(settings: CommonSettings) -> Doorbell | None:
    """This event loop's doorbell where ``kafka_doorbell`` is on."""
    if not settings.kafka_doorbell:
        return None
    return Doorbell.shared(settings.redis_url, settings.redis_prefix, settings.redis_credentials)


def make_producer(settings: CommonSettings, **overrides: Any) -> AIOKafkaProducer:
    """A producer (``seawall_client.kafka.new_producer``); where the doorbell is on, each
    acknowledged record rings its topic (``doorbell``)."""
    doorbell = doorbell_for(settings)
    if doorbell is not None:
        overrides.setdefault("delivered", doorbell.ring)
    return new_producer(settings.kafka, **overrides)


def make_consumer(
    settings: CommonSettings,
    *topics: str,
    group_id: str | None,
    rung: bool = True,
    **overrides: Any,
) -> Consumer:
    """A consumer (``seawall_client.kafka.new_consumer``); where the doorbell is on and
    its topics are ``rung`` (every producer of them rings), dormant between rings
    (``fetch_pacing.Dormancy``)."""
    options: dict[str, Any] = {
        "group_id": group_id,
        "session_timeout_ms": settings.consumer_session_timeout_ms,
        "heartbeat_interval_ms": settings.consumer_heartbeat_ms,
        "max_poll_interval_ms": 300_000,
    }
    options.update(overrides)
    doorbell = doorbell_for(settings) if rung else None
    if doorbell is None:
        return new_consumer(settings.kafka, *topics, **options)
    awake_ms = settings.consumer_fetch_busy_wait_ms or settings.consumer_fetch_max_wait_ms
    consumer = new_consumer(settings.kafka, *topics, dormancy=Dormancy(awake_ms), **options)
    doorbell.watch(consumer)
    return consumer


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A record to produce; ``partition`` ``None``: where its key hashes."""

    topic: str
    value: bytes
    key: bytes
    partition: int | None = None
    headers: list[tuple[str, bytes]] | None = None
    """Record headers (a ``traceparent``, say); aiokafka takes them as a list only."""


_BY_KEY = DefaultPartitioner()
_NO_HEADERS: list[tuple[str, bytes]] = []  # aiokafka's own default, never mutated


async def send_batched(
    producer: AIOKafkaProducer, records: Sequence[Outgoing]
) -> list[asyncio.Future[Any]]:
    """Hand ``records`` to ``producer`` as batches, one open per partition (aiokafka's
    ``send_batch``), instead of a ``send`` each: a send is a chain of coroutines, a
    future and a partitioner call per record, which came to a tenth of admission's CPU.
    Returns each record's acknowledgement — the future of the batch that carries it — in
    the order given; a record of a partition keeps its order among that partition's. A
    record without a partition goes where aiokafka's default partitioner would put it
    (murmur2 of its key), so a key keeps its partition either way. A batch the producer
    did not take has its records' futures failed with the error; nothing is raised.

    A record larger than a batch travels alone in one, so a record the broker refuses
    for its size fails alone."""
    loop = asyncio.get_running_loop()
    partitions: dict[str, list[int] | Exception] = {}
    """Per topic, its partitions, or why they could not be had: asked once per call, as
    the producer waits for the metadata (up to its request timeout) each time."""
    open_batches: dict[tuple[str, int], tuple[Any, list[int]]] = {}
    acks: list[asyncio.Future[Any] | None] = [None] * len(records)

    async def submit(topic: str, partition: int, batch: Any, members: list[int]) -> None:
        try:
            ack = await producer.send_batch(batch, topic, partition=partition)
        except Exception as e:
            ack = loop.create_future()
            ack.set_exception(e)
        for i in members:
            acks[i] = ack

    for index, record in enumerate(records):
        partition = record.partition
        if partition is None:
            known = partitions.get(record.topic)
            if known is None:
                try:
                    known = sorted(await producer.partitions_for(record.topic))
                except Exception as e:
                    known = e
                partitions[record.topic] = known
            if isinstance(known, Exception):
                failed: asyncio.Future[Any] = loop.create_future()
                failed.set_exception(known)
                acks[index] = failed
                continue
            partition = _BY_KEY(record.key, known, known)
        tp = (record.topic, partition)
        current = open_batches.get(tp)
        if current is None:
            current = open_batches[tp] = (producer.create_batch(), [])
        headers = record.headers or _NO_HEADERS
        appended = current[0].append(
            key=record.key, value=record.value, timestamp=None, headers=headers
        )
        if appended is None:
            await submit(record.topic, partition, *current)
            current = open_batches[tp] = (producer.create_batch(), [])
            current[0].append(key=record.key, value=record.value, timestamp=None, headers=headers)
        current[1].append(index)
    for (topic, partition), (batch, members) in open_batches.items():
        await submit(topic, partition, batch, members)
    return cast(list[asyncio.Future[Any]], acks)  # every record's slot is set above


async def wait_for_broker(broker: KafkaConfig | str, timeout_s: float = 30.0) -> None:
    """Return once the broker answers a metadata request; raise ``TimeoutError`` else.
    ``broker``: how to reach it (its TLS and SASL included), or a bare bootstrap
    string for a plaintext one (the embedded broker)."""
    config = as_config(broker)
    bootstrap = config.bootstrap
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        admin = new_admin(config, request_timeout_ms=3_000)
        try:
            await admin.start()
            await admin.list_topics()
            return
        except (KafkaError, OSError) as e:
            last = e
        finally:
            await admin.close()
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no Kafka broker answered at {bootstrap} within {timeout_s:.0f}s ({last})")


async def commit_done(consumer: AIOKafkaConsumer, offsets: OffsetTracker[TopicPartition]) -> None:
    """Commit what became safe to commit. A commit that loses to a rebalance is logged,
    not raised: the partitions' new owner processes those records again, and the
    duplicates are dropped downstream by request id. One the broker could not take
    (unavailable) is kept for the next call."""
    commits = offsets.take_commits()
    if not commits:
        return
    try:
        # aiokafka's commit first waits, unbounded, for the group's coordinator.
        async with asyncio.timeout(COMMIT_TIMEOUT_S):
            await consumer.commit(commits)
    except (CommitFailedError, IllegalStateError) as e:
        log.warning("commit failed", extra={"error": str(e)})
    except (KafkaError, TimeoutError) as e:
        offsets.restore(commits)
        log.warning("commit not taken; kept for the next one", extra={"error": repr(e)[:200]})
