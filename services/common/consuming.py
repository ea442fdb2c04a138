"""decode → decide → effect → commit: the one discipline of every consumer loop.

The rule: no record, whatever its bytes, can stop a consumer. A failure that belongs to
one record (``failures.is_infrastructure`` says which do not) becomes an answer to its
client, where a reply topic allows one, or a bounded dead letter, and the record's
offset moves on. Only the broker or Redis being unavailable pauses a loop: the same
records are tried again after a backoff (exponential, full jitter), and the loop goes
on by itself once they answer.

Two shapes of consumer use it:

- ``ConsumerLoop``, for consumers that finish a fetched batch before the next fetch
  (the Kafka ingress, admission's completions, the reply router, the control
  follower): a ``Handler`` ``decide``s every record of the batch (concurrently, at
  most ``concurrency`` at once, so that the fan-out to Redis is bounded; one at a
  time, in record order, with ``concurrency=1``), then queues
  each record's ``effect`` in record order, awaits the broker's acks, and the batch is
  committed (consumers in a group) once every record is settled.
- ``retry_unavailable``, for consumers that finish records at their own pace and commit
  through an ``OffsetTracker`` (admission's intake, workers): one record's step is
  retried while its failure is the infrastructure's; any other failure is the caller's
  to answer or dead-letter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError
from aiokafka.structs import ConsumerRecord
from prometheus_client import Counter, Gauge

from seawall_client.kafka import close
from services.common.deadletters import DeadLetters
from services.common.failures import Backoff, is_infrastructure
from services.common.lifecycle import Component, cancel_tasks

log = logging.getLogger(__name__)

Record: TypeAlias = ConsumerRecord[bytes, bytes]
D = TypeVar("D")
T = TypeVar("T")

PAUSES = Counter(
    "seawall_consumer_pauses_total",
    "Times a consumer loop paused because the broker or Redis was unavailable",
    ["loop"],
)
RECORD_FAILURES = Counter(
    "seawall_consumer_record_failures_total",
    "Records that failed on their own account (answered or dead-lettered)",
    ["loop"],
)
LAG = Gauge(
    "seawall_consumer_lag_records",
    "Records behind the end of a partition, as of the last batch read from it",
    ["loop", "topic", "partition"],
)


def observe_lag(
    loop: str, consumer: AIOKafkaConsumer, batches: Mapping[TopicPartition, Sequence[Record]]
) -> None:
    """Record each fetched partition's lag: its high watermark (from the same fetch)
    past the batch's last record. A partition with nothing fetched keeps its last
    value: reading nothing means nothing new, or the loop is paused on it."""
    for tp, records in batches.items():
        highwater = consumer.highwater(tp)
        if records and highwater is not None:
            lag = max(0, highwater - records[-1].offset - 1)
            LAG.labels(loop, tp.topic, str(tp.partition)).set(lag)


class Handler(Protocol[D]):
    """What a ``ConsumerLoop`` does with each record. Every method may raise: an
    infrastructure failure retries the record later, any other settles it through
    ``fail`` (and, if that fails too, a dead letter)."""

    async def decide(self, record: Record) -> D:
        """Decode the record and decide what to do (may read Redis)."""
        ...

    async def effect(self, record: Record, decision: D) -> Awaitable[Any] | None:
        """Queue the decision's effect; return what to await for its acknowledgement
        (``None`` once the effect is complete). Called in record order."""
        ...

    async def fail(self, record: Record, error: BaseException) -> None:
        """Settle a record that failed on its own account: answer its client where a
        reply topic allows, else dead-letter it."""
        ...


async def retry_unavailable(
    step: Callable[[], Awaitable[T]], backoff: Backoff, loop: str = "record"
) -> T:
    """``await step()``, again after a backoff each time it fails because the broker or
    Redis is unavailable; a failure of any other kind is raised to the caller."""
    while True:
        try:
            result = await step()
        except Exception as e:
            if not is_infrastructure(e):
                raise
            PAUSES.labels(loop).inc()
            log.warning("unavailable; trying again", extra={"loop": loop, "error": repr(e)[:200]})
            await backoff.wait()
            continue
        backoff.reset()
        return result


class ConsumerLoop(Component, Generic[D]):
    """Fetch a batch, settle every record of it (see the module notes), commit, repeat.

    ``commit``: whether the consumer belongs to a group whose offsets are committed
    (groupless readers start where their owner put them). ``after_fetch`` runs after
    every fetch, with or without records (periodic upkeep). On ``stop`` the batch in hand
    is finished within ``grace_s`` (and committed); what is not is fetched again by
    whoever owns its partition next.
    """

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        handler: Handler[D],
        dead_letters: DeadLetters | None,
        *,
        name: str,
        commit: bool,
        max_records: int = 500,
        concurrency: int = 32,
        fetch_timeout_ms: int = 200,
        grace_s: float = 10.0,
        backoff: Backoff | None = None,
        start_consumer: bool = True,
        after_fetch: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self._consumer = consumer
        self._handler = handler
        self._dead_letters = dead_letters
        self._commit = commit
        self._max_records = max_records
        self._concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)
        self._fetch_timeout_ms = fetch_timeout_ms
        self._grace_s = grace_s
        self._backoff = backoff or Backoff()
        self._start_consumer = start_consumer
        self._after_fetch = after_fetch
        self._loop: asyncio.Task[None] | None = None
        self._in_batch = False
        self._stopping = False

    async def on_start(self) -> None:
        self._loop = self.spawn(self._run(), "consume")

    async def on_stop(self) -> None:
        self._stopping = True
        if self._loop is not None:
            if self._in_batch:
                await asyncio.wait({self._loop}, timeout=self._grace_s)
            await cancel_tasks({self._loop})
        if self._start_consumer:
            await close(self._consumer)

    async def _run(self) -> None:
        consumer = self._consumer
        if self._start_consumer:
            # Joining a group takes a rebalance (seconds): the caller does not wait.
            await retry_unavailable(consumer.start, self._backoff, self.name)
        while not self._stopping:
            batches = await retry_unavailable(
                lambda: consumer.getmany(
                    timeout_ms=self._fetch_timeout_ms, max_records=self._max_records
                ),
                self._backoff,
                self.name,
            )
            observe_lag(self.name, consumer, batches)
            if batches:
                self._in_batch = True
                try:
                    await self.settle([r for records in batches.values() for r in records])
                    if self._commit:
                        await self._commit_batch(batches)
                finally:
                    self._in_batch = False
            if self._after_fetch is not None:
                self._after_fetch()

    async def settle(self, records: Sequence[Record]) -> None:
        """Decide, apply and acknowledge every record; return once each is settled."""
        pending = list(records)
        while pending:
            retry: list[Record] = []
            if self._concurrency == 1:  # in record order, without a task per record
                decided = [await self._decide(r) for r in pending]
            else:
                decided = await asyncio.gather(*(self._decide(r) for r in pending))
            acks: list[tuple[Record, Awaitable[Any]]] = []
            for record, (decision, error) in zip(pending, decided, strict=True):
                if error is None:
                    try:
                        ack = await self._handler.effect(record, decision)  # type: ignore[arg-type]
                    except Exception as e:
                        error = e
                    else:
                        if ack is not None:
                            acks.append((record, ack))
                        continue
                await self._failed(record, error, retry)
            outcomes = await asyncio.gather(*(a for _, a in acks), return_exceptions=True)
            for (record, _), outcome in zip(acks, outcomes, strict=True):
                if isinstance(outcome, Exception):
                    await self._failed(record, outcome, retry)
                elif isinstance(outcome, BaseException):
                    raise outcome
            pending = sorted(retry, key=lambda r: (r.topic, r.partition, r.offset))
            if pending:
                PAUSES.labels(self.name).inc()
                log.warning(
                    "broker or Redis unavailable; trying the records again",
                    extra={"loop": self.name, "records": len(pending)},
                )
                await self._backoff.wait()
            else:
                self._backoff.reset()

    async def _decide(self, record: Record) -> tuple[D | None, Exception | None]:
        async with self._slots:
            try:
                return await self._handler.decide(record), None
            except Exception as e:
                return None, e

    async def _failed(self, record: Record, error: Exception, retry: list[Record]) -> None:
        """Settle a failed record, or put it on ``retry`` if the failure (or the
        attempt to answer it) is the infrastructure's."""
        if is_infrastructure(error):
            retry.append(record)
            return
        RECORD_FAILURES.labels(self.name).inc()
        try:
            await self._handler.fail(record, error)
        except Exception as e:
            if is_infrastructure(e):
                retry.append(record)
                return
            if self._dead_letters is None:
                raise
            log.error(
                "could not answer a failed record; dead-lettering it",
                extra={"loop": self.name, "error": type(e).__name__},
            )
            await self._dead_letters.record(record, error)

    async def _commit_batch(self, batches: dict[TopicPartition, list[Record]]) -> None:
        offsets = {tp: records[-1].offset + 1 for tp, records in batches.items()}
        try:
            await retry_unavailable(
                lambda: self._consumer.commit(offsets), self._backoff, self.name
            )
        except (CommitFailedError, IllegalStateError) as e:
            # A rebalance took the partitions: their new owner handles them again.
            log.warning("commit failed", extra={"loop": self.name, "error": str(e)})
