"""The worker's consumer of its pool's dispatch topic: fetching, membership, commits.

The fetch loop asks the consumer for records only while there is room under the batch
limit, and hands each to serving as a task of its own. The worker's breaker isolating
it (``control_reactions``) makes it step aside: finish what it has (within the grace
period), commit and leave the consumer group, so that its partitions go to the rest of
the pool; it rejoins once the breaker no longer isolates it. Offsets are committed
every ``commit_interval_s``, and before partitions are revoked.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from seawall_client.kafka import close
from seawall_client.topics import Topics
from services.common.bus import commit_done, make_consumer
from services.common.consuming import Record, observe_lag, retry_unavailable
from services.common.failures import Backoff
from services.common.offsets import OffsetTracker
from services.workers import metrics as m
from services.workers.runs import InHand
from services.workers.settings import WorkerSettings

log = logging.getLogger(__name__)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, fetching: Fetching) -> None:
        self._fetching = fetching

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._fetching.commit_done()
        self._fetching.offsets.forget(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        log.info("partitions assigned", extra={"partitions": len(assigned)})


class Fetching:
    """The dispatch topic's consumer, from its start to its close."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        topics: Topics,
        offsets: OffsetTracker[TopicPartition],
        in_hand: InHand,
        isolated: Callable[[], bool],
        serve: Callable[[TopicPartition, Record, str], Coroutine[Any, Any, None]],
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
    ) -> None:
        self.settings = settings
        self.topics = topics
        self.offsets = offsets
        self._in_hand = in_hand
        self._isolated = isolated
        self._serve = serve
        self.spawn = spawn
        self._consumer: AIOKafkaConsumer | None = None
        self.draining = False
        self.stepped_aside = False
        """Out of the consumer group because the worker's breaker isolates it."""

    async def start(self) -> None:
        self._consumer = make_consumer(
            self.settings,
            group_id=f"{self.settings.topic_prefix}seawall.workers.{self.settings.pool}",
        )
        self._consumer.subscribe(
            [self.topics.dispatch(self.settings.pool)], listener=_Rebalance(self)
        )
        await self._consumer.start()

    async def close(self) -> None:
        if self._consumer is not None:
            await close(self._consumer)

    @property
    def partitions(self) -> frozenset[TopicPartition]:
        """The dispatch partitions the group gave this worker."""
        return frozenset(self._consumer.assignment()) if self._consumer else frozenset()

    async def loop(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        backoff = Backoff()
        while not self.draining:
            async with self._in_hand.capacity:
                await self._in_hand.capacity.wait_for(
                    lambda: (
                        self.draining
                        or self._isolated() != self.stepped_aside
                        or (
                            self._in_hand.in_flight < self._in_hand.batch_limit
                            and not self.stepped_aside
                        )
                    )
                )
            if self.draining:
                return
            if self._isolated() and not self.stepped_aside:
                await self._step_aside(consumer)
                continue
            if not self._isolated() and self.stepped_aside:
                self._rejoin(consumer)
                continue
            batches = await retry_unavailable(
                functools.partial(
                    consumer.getmany,
                    timeout_ms=200,
                    max_records=self._in_hand.batch_limit - self._in_hand.in_flight,
                ),
                backoff,
                "worker-fetch",
            )
            observe_lag("worker", consumer, batches)
            for tp, records in batches.items():
                for record in records:
                    self.offsets.track(tp, record.offset)
                    key = f"{tp.partition}:{record.offset}"
                    self._in_hand.requests[key] = self.spawn(
                        self._serve(tp, record, key), f"serve:{key}"
                    )
            m.IN_FLIGHT.labels(self.settings.pool).set(self._in_hand.in_flight)

    async def _step_aside(self, consumer: AIOKafkaConsumer) -> None:
        log.warning(
            "my breaker isolates me: leaving the group",
            extra={"in_flight": self._in_hand.in_flight, "grace_s": self.settings.shutdown_grace_s},
        )
        pending = set(self._in_hand.requests.values())
        if pending:
            await asyncio.wait(pending, timeout=self.settings.shutdown_grace_s)
        await self.commit_done()
        # What is still running is redelivered to the new owners of its partitions.
        self.offsets.forget(consumer.assignment())
        consumer.unsubscribe()
        self.stepped_aside = True
        m.STEPPED_ASIDE.labels(self.settings.pool).set(1)

    def _rejoin(self, consumer: AIOKafkaConsumer) -> None:
        log.info("my breaker lets me serve again: rejoining the group")
        consumer.subscribe([self.topics.dispatch(self.settings.pool)], listener=_Rebalance(self))
        self.stepped_aside = False
        m.STEPPED_ASIDE.labels(self.settings.pool).set(0)

    async def commit_done(self) -> None:
        if self._consumer is not None:
            await commit_done(self._consumer, self.offsets)

    async def commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.commit_interval_s)
            await self.commit_done()
