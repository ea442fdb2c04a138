"""Kafka plumbing: topic creation, producer and consumer factories, commits.

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
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    CommitFailedError,
    IllegalStateError,
    KafkaError,
    TopicAlreadyExistsError,
)

from services.common.offsets import OffsetTracker
from services.common.settings import CommonSettings
from services.common.topics import Topics, TopicSpec

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S: Final = 15.0
"""How long a Kafka client may take to close before it is abandoned."""
COMMIT_TIMEOUT_S: Final = 10.0
"""How long a commit may wait (for the group's coordinator, then for its answer)."""


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
        "session_timeout_ms": settings.consumer_session_timeout_ms,
        "heartbeat_interval_ms": settings.consumer_heartbeat_ms,
        "fetch_max_wait_ms": settings.consumer_fetch_max_wait_ms,
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
    """Create the topics that do not exist yet, with their partitions, retention and
    ``replication`` (never left to a broker's auto-creation, which production Kafka
    turns off and which would pick its own defaults). Services pass their
    ``topic_replication``: whichever starts first creates the fleet's topics, so each
    must ask for the same. Returns the names created."""
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


async def close(client: AIOKafkaConsumer | AIOKafkaProducer) -> None:
    """Stop ``client`` within ``CLOSE_TIMEOUT_S``, else abandon it. A consumer's stop
    waits, with no bound, for its group coordination to finish — a join the broker is
    slow to answer, say (aio-libs/aiokafka#773) — and a service's stop must not hang
    with it. An abandoned consumer leaves its group by the session timeout, as a killed
    one does; a producer is closed only after every effect it carried was acknowledged
    (services commit nothing earlier), so abandoning it loses nothing committed."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await client.stop()
    except TimeoutError:
        log.warning(
            "kafka client did not close in time; abandoned",
            extra={"client": type(client).__name__, "timeout_s": CLOSE_TIMEOUT_S},
        )


async def start_tail(consumer: AIOKafkaConsumer, *topics: str) -> None:
    """Start a groupless consumer on every partition of ``topics``, from their end:
    for readers of what happens from now on (reports, hints), not of history."""
    await consumer.start()
    await consumer.topics()  # loads the metadata: the topics' partitions
    tps = [
        TopicPartition(topic, p)
        for topic in topics
        for p in sorted(consumer.partitions_for_topic(topic) or {0})
    ]
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)
    for tp in tps:
        await consumer.position(tp)  # resolved now, not at the first fetch
