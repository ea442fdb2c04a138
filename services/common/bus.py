"""Kafka plumbing: topic creation, producer and consumer factories, dead letters.

Producers use ``acks=all``; idempotence follows ``SEAWALL_KAFKA_IDEMPOTENCE`` (off on the
embedded broker, see DESIGN's Platform facts). Consumers never auto-commit: services
commit an offset only after its effect is durable (at-least-once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import CommitFailedError, KafkaError, TopicAlreadyExistsError
from aiokafka.structs import ConsumerRecord

from schemas import DeadLetter
from services.common.clock import SYSTEM_CLOCK, Clock
from services.common.offsets import OffsetTracker
from services.common.serde import DecodeError, encode
from services.common.settings import CommonSettings
from services.common.topics import Topics, TopicSpec

log = logging.getLogger(__name__)


def topics_of(settings: CommonSettings) -> Topics:
    return Topics(settings.topic_prefix, settings.topic_partitions, settings.pools)


class Producer(AIOKafkaProducer):  # type: ignore[misc]
    """aiokafka's producer, keeping every topic it writes to in its metadata.

    aiokafka refreshes metadata only for the topics its client tracks, and tracks a
    topic only if it was missing from the metadata when first written to. A topic known
    from the start-up metadata (a dispatch topic, say) is then dropped by the first
    refresh made for a new topic (a client's new reply topic), and batches waiting for
    it stall until they expire with ``NotLeaderForPartitionError``.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._tracked: set[str] = set()

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> Any:
        if topic not in self._tracked:
            self._tracked.add(topic)
            self.client.add_topic(topic)
        return await super().send(topic, *args, **kwargs)


def make_producer(settings: CommonSettings, **overrides: Any) -> AIOKafkaProducer:
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "client_id": f"seawall-{settings.instance_id}",
        "acks": "all",
        "enable_idempotence": settings.kafka_idempotence,
        "linger_ms": 1,
        "request_timeout_ms": 15_000,
    }
    options.update(overrides)
    return Producer(**options)


def make_consumer(
    settings: CommonSettings, *topics: str, group_id: str | None, **overrides: Any
) -> AIOKafkaConsumer:
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "client_id": f"seawall-{settings.instance_id}",
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "session_timeout_ms": 10_000,
        "heartbeat_interval_ms": 1_000,
        "max_poll_interval_ms": 300_000,
    }
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


async def wait_for_broker(bootstrap: str, timeout_s: float = 30.0) -> None:
    """Return once the broker answers a metadata request; raise ``TimeoutError`` else."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3_000)
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


async def ensure_topics(
    bootstrap: str, specs: Iterable[TopicSpec], replication: int = 1
) -> list[str]:
    """Create the topics that do not exist yet (the embedded broker does not
    auto-create them). Returns the names created."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15_000)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [s for s in specs if s.name not in existing]
        if missing:
            # Another process may create them meanwhile.
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(
                    [
                        NewTopic(s.name, s.partitions, replication, topic_configs=s.config)
                        for s in missing
                    ]
                )
        return [s.name for s in missing]
    finally:
        await admin.close()


async def send_dead_letter(
    producer: AIOKafkaProducer,
    topics: Topics,
    *,
    source_topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    raw: bytes | None,
    error: DecodeError,
    service: str,
    clock: Clock = SYSTEM_CLOCK,
) -> None:
    """Keep a record no one can use, whole, with the reason; wait for the broker's ack so
    that the caller may commit the record's offset afterwards."""
    letter = DeadLetter(
        source_topic=source_topic,
        partition=partition,
        offset=offset,
        key=key,
        raw=raw or b"",
        reason=error.reason,
        error=error.message[:512],
        service=service,
        at=clock.time(),
    )
    await producer.send_and_wait(topics.deadletter, encode(letter), key=source_topic.encode())
    log.warning(
        "dead-lettered a record",
        extra={
            "source": source_topic,
            "partition": partition,
            "offset": offset,
            "reason": error.reason,
        },
    )


async def dead_letter_record(
    producer: AIOKafkaProducer,
    topics: Topics,
    record: ConsumerRecord[bytes, bytes],
    error: DecodeError,
    *,
    service: str,
    clock: Clock = SYSTEM_CLOCK,
) -> None:
    """``send_dead_letter`` for a consumed record, kept whole."""
    await send_dead_letter(
        producer,
        topics,
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
        raw=record.value,
        error=error,
        service=service,
        clock=clock,
    )


async def commit_done(consumer: AIOKafkaConsumer, offsets: OffsetTracker[TopicPartition]) -> None:
    """Commit what became safe to commit. A commit that loses to a rebalance is logged,
    not raised: the partitions' new owner processes those records again, and the
    duplicates are dropped downstream by request id."""
    commits = offsets.take_commits()
    if not commits:
        return
    try:
        await consumer.commit(commits)
    except CommitFailedError as e:
        log.warning("commit failed", extra={"error": str(e)})
