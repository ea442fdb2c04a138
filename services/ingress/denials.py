"""Failed authentication costs the attacker, not ingress.

- ``FailureLimiter`` (pure; time is passed in): a token bucket per subject — a client
  address, a key id — refilled at ``rate_per_s`` up to ``burst``; every failure takes a
  token. ``exhausted`` says a subject has failed too often lately.
- ``DenialAudit``: the audit trail of denials, off the request path. ``note`` never
  waits: it queues an ``AuditEvent`` (at most ``burst`` per key id, then one per
  ``1/rate_per_s``; the events left out are counted into the next one's ``suppressed``)
  and a background task produces the queue in batches. A full queue drops (counted in
  ``seawall_ingress_audit_dropped_total``) rather than slow a request down.

HTTP refuses a client address that has failed too often (429 before any key lookup,
until its bucket refills); a key id is never locked out that way (anyone could then
lock its owner out), its denials are only audited sparingly.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from aiokafka import AIOKafkaProducer
from prometheus_client import Counter

from schemas import AuditEvent
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.serde import encode
from services.common.lifecycle import Component, cancel_tasks

log = logging.getLogger(__name__)

DROPPED = Counter(
    "seawall_ingress_audit_dropped_total", "Denial audit events dropped: the queue was full"
)
SUPPRESSED = Counter(
    "seawall_ingress_audit_suppressed_total",
    "Denial audit events folded into a later one (rate-limited per key id)",
)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float
    skipped: int = 0


class FailureLimiter:
    """Token buckets per subject, at most ``max_subjects`` of them (least recently
    failed forgotten first: a forgotten subject starts again with a full bucket)."""

    def __init__(self, rate_per_s: float, burst: float, max_subjects: int = 10_000) -> None:
        if rate_per_s <= 0 or burst < 1 or max_subjects < 1:
            raise ValueError("need rate_per_s > 0, burst >= 1 and max_subjects >= 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._max = max_subjects
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def _refilled(self, subject: str, now: float) -> _Bucket:
        b = self._buckets.get(subject)
        if b is None:
            b = self._buckets[subject] = _Bucket(self.burst, now)
        else:
            b.tokens = min(self.burst, b.tokens + max(0.0, now - b.at) * self.rate_per_s)
            b.at = max(b.at, now)
        self._buckets.move_to_end(subject)
        while len(self._buckets) > self._max:
            self._buckets.popitem(last=False)
        return b

    def fail(self, subject: str, now: float) -> tuple[bool, int]:
        """One more failure of ``subject``. Returns whether it is within its budget and,
        if so, how many failures over budget were skipped since the last one within."""
        b = self._refilled(subject, now)
        if b.tokens >= 1:
            b.tokens -= 1
            skipped, b.skipped = b.skipped, 0
            return True, skipped
        b.skipped += 1
        return False, 0

    def exhausted(self, subject: str, now: float) -> float:
        """Seconds until ``subject`` may fail again (0: it may now)."""
        b = self._buckets.get(subject)
        if b is None:
            return 0.0
        tokens = min(self.burst, b.tokens + max(0.0, now - b.at) * self.rate_per_s)
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate_per_s


class DenialAudit(Component):
    """Denials on ``llm.audit`` without holding up the request (module notes)."""

    name = "denial-audit"

    def __init__(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        actor: str,
        limiter: FailureLimiter,
        clock: Clock = SYSTEM_CLOCK,
        queue_size: int = 10_000,
        batch: int = 200,
    ) -> None:
        super().__init__()
        self._producer = producer
        self._topic = topic
        self._actor = actor
        self._limiter = limiter
        self._clock = clock
        self._queue: asyncio.Queue[AuditEvent] = asyncio.Queue(queue_size)
        self._batch = batch
        self._flusher: asyncio.Task[Any] | None = None

    def note(
        self,
        tenant: str,
        key_id: str,
        detail: dict[str, str],
        action: Literal["key_denied", "request_blocked"] = "key_denied",
    ) -> None:
        """Audit a denial for ``key_id``, unless its budget is spent (then it is counted
        into the next event that is written)."""
        now = self._clock.time()
        within, skipped = self._limiter.fail(key_id, self._clock.monotonic())
        if not within:
            SUPPRESSED.inc()
            return
        if skipped:
            detail = detail | {"suppressed": str(skipped)}
        event = AuditEvent(
            tenant=tenant,
            actor=self._actor,
            action=action,
            outcome="denied",
            key_id=key_id,
            detail=detail,
            at=now,
        )
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            DROPPED.inc()

    async def on_start(self) -> None:
        self._flusher = self.spawn(self._flush_loop(), "flush")

    async def on_stop(self) -> None:
        if self._flusher is not None:
            await cancel_tasks({self._flusher})
        await self._flush()

    async def _flush_loop(self) -> None:
        while True:
            first = await self._queue.get()
            await self._send([first, *self._take(self._batch - 1)])

    def _take(self, n: int) -> list[AuditEvent]:
        return [self._queue.get_nowait() for _ in range(min(n, self._queue.qsize()))]

    async def _flush(self) -> None:
        while not self._queue.empty():
            await self._send(self._take(self._batch))

    async def _send(self, events: list[AuditEvent]) -> None:
        """Produce a batch, its acks awaited together. A broker that does not take them
        loses them (counted): the audit of denials never blocks ingress."""
        try:
            sends = [
                await self._producer.send(self._topic, encode(e), key=e.tenant.encode())
                for e in events
            ]
            await asyncio.gather(*sends)
        except Exception as e:
            DROPPED.inc(len(events))
            log.warning("denial audit not written", extra={"error": type(e).__name__})
