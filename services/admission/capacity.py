"""How much work each pool can absorb now: the pacing rule of admission (pure).

Admission dispatches to a pool only into free batch slots, so the pool's dispatch topic
never holds more than a few records: a burst of bulk work waits in admission, in
priority order, and a VIP request arriving later overtakes it there.

The rule, per pool::

    free = Σ max(1, ⌊batch_limit × factor⌋) + slack − in_pool

over the pool's *live* workers: heard from (``EngineStats`` or ``WorkerHeartbeat``)
within ``worker_timeout_s``, last heartbeat status ``starting`` or ``serving`` (not
``draining`` or ``stopped``), and with a share above 0. ``factor`` is 1, or less under
a pool breaker at level 2 (rate limit); a worker's ``share`` (``policy.worker_share``)
is 1, less under its own rate-limiting breaker, 0 when its breaker isolates it. A
worker's term is ``max(1, ⌊batch_limit × factor × share⌋)``. ``slack`` lets a
worker find its next record already waiting when a slot frees. ``in_pool`` is the
larger of two estimates of the requests dispatched and not yet finished:

- *telemetry*: Σ (``in_flight`` of the worker's latest report − the completions it
  reported since; a worker's telemetry is one partition, so "since" is record order,
  no clocks compared) + our dispatches made after the oldest of those reports was
  received (not yet reflected in any report; a conservative count);
- *ledger*: the dispatches of this admission instance with no ``RequestCompleted`` yet
  (by request id; forgotten after ``ledger_ttl_s`` in case a completion is lost).

The ledger is exact for one admission instance, including records still waiting in
Kafka, which the telemetry cannot see; the telemetry covers the other instances'
dispatches (up to one report interval late). A pool with no live worker has no
capacity: its work waits (and expires at its deadline).

``max_model_len`` is the longest sequence every live worker of a pool can run (the
smallest their ``EngineStats`` report): what admission checks a request's prompt plus
``max_tokens`` against before it costs any quota.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from schemas import EngineStats, RequestCompleted, TelemetryEvent, WorkerHeartbeat

WorkerStatus = Literal["starting", "serving", "draining", "stopped"]
_ABSORBING: frozenset[WorkerStatus] = frozenset({"starting", "serving"})


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    worker_timeout_s: float = 10.0
    slack: int = 2
    ledger_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if self.worker_timeout_s <= 0 or self.ledger_ttl_s <= 0 or self.slack < 0:
            raise ValueError("timeouts must be positive and the slack not negative")


@dataclass(slots=True)
class _Worker:
    pool: str
    batch_limit: int
    in_flight: int
    reported_at: float
    """When its latest ``in_flight`` report was read."""
    heard_at: float
    """When anything of it was last read (liveness)."""
    status: WorkerStatus = "serving"
    completed_since_report: int = 0
    max_model_len: int = 0
    """From its ``EngineStats``; 0 until one says."""


@dataclass(slots=True)
class _Pool:
    ledger: OrderedDict[str, float] = field(default_factory=OrderedDict)
    """Request id → when this instance dispatched it, oldest first."""


@dataclass(frozen=True, slots=True)
class PoolView:
    """One pool's figures, as the pacing rule saw them."""

    workers: int
    slots: int
    in_pool: int
    free: int


class FleetCapacity:
    """The pools' free capacity, from telemetry and this instance's own dispatches.

    ``now`` is a monotonic reading of the caller's clock (when a record was read), never
    a worker's timestamp, so clock skew between hosts does not matter.
    """

    def __init__(self, config: CapacityConfig | None = None) -> None:
        self.config = config or CapacityConfig()
        self._workers: dict[str, _Worker] = {}
        self._shares: dict[str, float] = {}
        self._pools: dict[str, _Pool] = {}
        self._model_lens: dict[str, int] = {}
        """Worker id → the ``max_model_len`` its engine reported."""

    # -- inputs ------------------------------------------------------------------
    def report(
        self,
        worker_id: str,
        pool: str,
        *,
        batch_limit: int,
        in_flight: int,
        now: float,
        status: WorkerStatus | None = None,
    ) -> None:
        """An ``EngineStats`` (``status=None``) or a ``WorkerHeartbeat``."""
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker(pool, batch_limit, in_flight, now, now)
        w.pool, w.batch_limit, w.in_flight = pool, batch_limit, in_flight
        w.reported_at = w.heard_at = now
        w.completed_since_report = 0
        if status is not None:
            w.status = status

    def observe(self, event: TelemetryEvent, now: float) -> None:
        """A telemetry record, whatever its kind (those that say nothing of capacity are
        ignored): what admission's telemetry loop feeds."""
        if isinstance(event, EngineStats | WorkerHeartbeat):
            if isinstance(event, EngineStats) and event.limits.max_model_len:
                self._model_lens[event.worker_id] = event.limits.max_model_len
            self.report(
                event.worker_id,
                event.pool,
                batch_limit=event.batch_limit,
                in_flight=event.in_flight,
                now=now,
                status=event.status if isinstance(event, WorkerHeartbeat) else None,
            )
        elif isinstance(event, RequestCompleted):
            self.completed(event.worker_id, event.request_id, now)

    def completed(self, worker_id: str, request_id: str, now: float) -> None:
        """A ``RequestCompleted``: the slot is free, and the request leaves the ledger."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.completed_since_report += 1
            w.heard_at = now
            self._pool(w.pool).ledger.pop(request_id, None)
        else:
            for p in self._pools.values():
                p.ledger.pop(request_id, None)

    def share(self, worker_id: str, share: float) -> None:
        """The part of its batch slots a worker's breaker leaves it: 1 all, 0 isolated."""
        if not 0.0 <= share <= 1.0:
            raise ValueError("a share lies in [0, 1]")
        if share == 1.0:
            self._shares.pop(worker_id, None)
        else:
            self._shares[worker_id] = share

    def dispatched(self, pool: str, request_id: str, now: float) -> None:
        ledger = self._pool(pool).ledger
        ledger.pop(request_id, None)  # a re-dispatch counts once, from now
        ledger[request_id] = now

    # -- the rule ------------------------------------------------------------------
    def view(self, pool: str, now: float, factor: float = 1.0) -> PoolView:
        if not 0.0 <= factor <= 1.0:
            raise ValueError("factor must lie in [0, 1]")
        ledger = self._pool(pool).ledger
        self._forget_old(ledger, now)
        live = self._live(pool, now)
        if not live:
            return PoolView(0, 0, len(ledger), 0)
        slots = sum(
            max(1, math.floor(w.batch_limit * factor * self._shares.get(wid, 1.0)))
            for wid, w in live
        )
        reported = sum(max(0, w.in_flight - w.completed_since_report) for _, w in live)
        oldest_report = min(w.reported_at for _, w in live)
        unreflected = 0
        for dispatched_at in reversed(ledger.values()):
            if dispatched_at <= oldest_report:
                break
            unreflected += 1
        in_pool = max(len(ledger), reported + unreflected)
        return PoolView(len(live), slots, in_pool, max(0, slots + self.config.slack - in_pool))

    def free(self, pool: str, now: float, factor: float = 1.0) -> int:
        return self.view(pool, now, factor).free

    def model_lens(self, now: float) -> dict[str, int]:
        """Per pool, the ``max_model_len`` every live worker can run (pools whose
        workers have not reported one are left out)."""
        lens: dict[str, int] = {}
        for pool in {w.pool for w in self._workers.values()}:
            known = [
                self._model_lens[wid] for wid, _ in self._live(pool, now) if wid in self._model_lens
            ]
            if known:
                lens[pool] = min(known)
        return lens

    # -- internals -------------------------------------------------------------------
    def _pool(self, pool: str) -> _Pool:
        return self._pools.setdefault(pool, _Pool())

    def _live(self, pool: str, now: float) -> list[tuple[str, _Worker]]:
        silent = [
            wid
            for wid, w in self._workers.items()
            if now - w.heard_at > self.config.worker_timeout_s
        ]
        for wid in silent:  # forgotten; a report brings a worker back
            del self._workers[wid]
            self._model_lens.pop(wid, None)
        return [
            (wid, w)
            for wid, w in self._workers.items()
            if w.pool == pool and w.status in _ABSORBING and self._shares.get(wid, 1.0) > 0
        ]

    def _forget_old(self, ledger: OrderedDict[str, float], now: float) -> None:
        while ledger:
            first = next(iter(ledger.values()))
            if now - first <= self.config.ledger_ttl_s:
                break
            ledger.popitem(last=False)
