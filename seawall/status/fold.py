"""The pure part of ``seawall status``: ``StatusFold`` folds telemetry and control
records, as read from the broker, into a ``FleetStatus`` at an injected ``now``: the
workers heard from in the telemetry window (alive, or stale once silent longer than the
controller's heartbeat timeout), the pools, the decisions in force (breakers,
degradation levels, batch limits: per ``<kind>/<scope>`` the highest ``seq`` wins,
applied by the ``ControlState`` every consumer uses) and how old the newest decision
is. ``lags`` turns committed and end offsets into consumer-group lags.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

from aiokafka import TopicPartition

from schemas import (
    BatchLimit,
    BreakerState,
    ControlEvent,
    DegradationLevel,
    EngineStats,
    GpuStats,
    QuotaOverride,
    RegionThrottle,
    WorkerHeartbeat,
    WorkerReport,
)
from seawall.events import describe, expired
from seawall_client.serde import CONTROL, TELEMETRY, DecodeError, decode
from services.common.control_signing import ControlVerifier
from services.common.control_state import ControlState
from services.controller.settings import ControllerSettings

STALE_AFTER_S: float = ControllerSettings.model_fields["controller_heartbeat_timeout_s"].default
"""A worker silent this long is stale: the controller's default heartbeat timeout, after
which the controller takes the worker out of its pool."""
GROUP_STEM = "seawall"
"""The fleet's consumer groups are all named ``<topic prefix>seawall…``: ``seawall.ingress``,
``seawall.admission``, ``seawall.admission.completions``, ``seawall.workers.<pool>``
and the controller's ``seawall-controller``."""

K = TypeVar("K")
T = TypeVar("T", WorkerHeartbeat, EngineStats, GpuStats)


@dataclass(frozen=True, slots=True)
class GpuView:
    """``None``: a figure the device does not report."""

    index: int
    name: str
    utilization_pct: float | None
    temperature_c: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    simulated: bool


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: str
    pool: str
    last_seen_s: float
    """Seconds since the worker's newest telemetry (stamped by the worker's clock)."""
    alive: bool
    """Heard from within the stale threshold, and not reporting ``stopped``."""
    status: str | None
    """The newest heartbeat's status; ``None`` without a heartbeat in the window."""
    engine: str | None
    in_flight: int | None
    running: int | None
    waiting: int | None
    kv_cache_usage: float | None
    batch_limit: int | None
    """The limit the worker reports applying (to compare with the decision in force)."""
    gpus: tuple[GpuView, ...]


@dataclass(frozen=True, slots=True)
class PoolView:
    pool: str
    workers: int
    alive: int
    in_flight: int
    """Summed over the pool's alive workers."""
    waiting: int
    """Summed over the pool's alive workers."""
    degradation: int | None
    """The level in force for ``pool:<pool>``; ``None``: never decided."""
    breaker: str | None
    """The state of the ``pool:<pool>`` breaker; ``None``: never decided."""


@dataclass(frozen=True, slots=True)
class Decided:
    """How a decision in force came about, and whether it can still be trusted."""

    summary: str
    """The decision in a few words, as ``seawall events`` prints it."""
    seq: int
    issued_at: float
    age_s: float
    expired: bool
    """Past ``valid_for_s`` without a re-publication."""
    reason: str

    @classmethod
    def of(cls, event: ControlEvent, now: float) -> Decided:
        return cls(
            summary=describe(event),
            seq=event.seq,
            issued_at=event.issued_at,
            age_s=now - event.issued_at,
            expired=expired(event, now),
            reason=event.evidence.reason,
        )


@dataclass(frozen=True, slots=True)
class BreakerView:
    scope: str
    state: str
    level: str
    tripped: tuple[str, ...]
    decided: Decided


@dataclass(frozen=True, slots=True)
class DegradationView:
    scope: str
    level: int
    small_pool: str | None
    max_tokens_cap: int | None
    decided: Decided


@dataclass(frozen=True, slots=True)
class BatchLimitView:
    scope: str
    worker_id: str
    limit: int
    decided: Decided


def _steers(event: QuotaOverride | RegionThrottle, now: float) -> bool:
    """Whether an override or throttle changes anything now (a cleared one does not)."""
    if isinstance(event, RegionThrottle):
        return event.rate_per_s is not None
    terms = (event.requests_per_s, event.tokens_per_s, event.burst)
    live = event.expires_at is None or now < event.expires_at
    return live and any(t is not None for t in terms)


@dataclass(frozen=True, slots=True)
class OverrideView:
    """An operator's quota override or region throttle in force (``seawall quota``,
    ``seawall region``)."""

    scope: str
    issuer: str
    decided: Decided


@dataclass(frozen=True, slots=True)
class TopicLag:
    """One consumer group on one topic, over the partitions it committed an offset on."""

    group: str
    topic: str
    partitions: int
    committed: int
    end: int
    lag: int
    """Records not yet committed: ``end - committed``."""


@dataclass(frozen=True, slots=True)
class FleetStatus:
    now: float
    window_s: float
    stale_after_s: float
    workers: tuple[WorkerView, ...]
    pools: tuple[PoolView, ...]
    breakers: tuple[BreakerView, ...]
    degradations: tuple[DegradationView, ...]
    batch_limits: tuple[BatchLimitView, ...]
    overrides: tuple[OverrideView, ...]
    groups: tuple[str, ...]
    """The fleet's consumer groups known to the broker, with or without commits."""
    lags: tuple[TopicLag, ...]
    control_age_s: float | None
    """Seconds since the newest control event was issued; ``None``: none was read. The
    controller re-publishes the decisions in force every few seconds, so an age that
    keeps growing means it has fallen silent."""
    control_events: int
    control_refused: int
    """Control records the followers refuse (not signed by a key they trust, or not the
    signer's to issue): left out of the state shown."""
    telemetry_events: int
    """Telemetry records read that fall in the window."""
    invalid_records: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def lags(
    committed: Mapping[str, Mapping[TopicPartition, int]], ends: Mapping[TopicPartition, int]
) -> tuple[TopicLag, ...]:
    """Per group and topic (sorted), the lag over the partitions with a committed offset
    and a known end. An end below the committed offset (Tansu's end offset is the first
    offset of a partition's last record batch plus one) counts as the committed offset:
    no lag."""
    out: list[TopicLag] = []
    for group, offsets in sorted(committed.items()):
        by_topic: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for tp, offset in offsets.items():
            if tp in ends:
                by_topic[tp.topic].append((offset, max(offset, ends[tp])))
        out.extend(
            TopicLag(
                group=group,
                topic=topic,
                partitions=len(pairs),
                committed=sum(c for c, _ in pairs),
                end=sum(e for _, e in pairs),
                lag=sum(e - c for c, e in pairs),
            )
            for topic, pairs in sorted(by_topic.items())
        )
    return tuple(out)


def _keep_newest(held: dict[K, T], key: K, event: T) -> None:
    current = held.get(key)
    if current is None or event.at >= current.at:
        held[key] = event


def _since(event: T | None, since: float) -> T | None:
    return event if event is not None and event.at >= since else None


class StatusFold:
    """Telemetry and control records in, a ``FleetStatus`` out. No I/O and no clock: the
    records carry their times and ``result`` takes ``now``. Records may come in any
    order; per worker (and GPU) the newest ``at`` wins."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self.control = ControlState(in_force_only=False)
        self.control_events = 0
        self.invalid = 0
        self.refused = 0
        self._newest_issued: float | None = None
        self._seen: dict[str, tuple[float, str]] = {}
        """Per worker: the ``at`` and pool of its newest telemetry of any type."""
        self._heartbeats: dict[str, WorkerHeartbeat] = {}
        self._engines: dict[str, EngineStats] = {}
        self._gpus: dict[tuple[str, int], GpuStats] = {}
        self._telemetry_at: list[float] = []

    def feed_control(
        self,
        raw: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        verifier: ControlVerifier | None = None,
    ) -> None:
        """One control record; with ``verifier``, one the followers refuse (its
        signature) is left out, as they leave it out."""
        try:
            event = decode(CONTROL, raw)
        except DecodeError:
            self.invalid += 1
            return
        if verifier is not None and verifier.check(raw or b"", headers, event) is not None:
            self.refused += 1
            return
        self.control_events += 1
        self.control.apply(event)
        if self._newest_issued is None or event.issued_at > self._newest_issued:
            self._newest_issued = event.issued_at

    def feed_telemetry(self, raw: bytes | None) -> None:
        try:
            event = decode(TELEMETRY, raw)
        except DecodeError:
            self.invalid += 1
            return
        self._telemetry_at.append(event.at)
        seen = self._seen.get(event.worker_id)
        if seen is None or event.at >= seen[0]:
            self._seen[event.worker_id] = (event.at, event.pool)
        for part in event.parts() if isinstance(event, WorkerReport) else (event,):
            if isinstance(part, WorkerHeartbeat):
                _keep_newest(self._heartbeats, part.worker_id, part)
            elif isinstance(part, EngineStats):
                _keep_newest(self._engines, part.worker_id, part)
            else:
                _keep_newest(self._gpus, (part.worker_id, part.gpu_index), part)

    def result(
        self,
        now: float,
        window_s: float,
        pools: Iterable[str] = (),
        groups: Iterable[str] = (),
        lag: tuple[TopicLag, ...] = (),
    ) -> FleetStatus:
        """The status at ``now`` from the telemetry of the last ``window_s`` seconds.
        ``pools`` (the configured ones) are listed even when no worker of theirs is."""
        since = now - window_s
        workers = tuple(
            self._worker(worker_id, at, pool, now, since)
            for worker_id, (at, pool) in sorted(self._seen.items())
            if at >= since
        )
        breakers = sorted(
            (
                BreakerView(e.scope, e.state, e.level.name, e.tripped, Decided.of(e, now))
                for e in self.control.all(BreakerState)
            ),
            key=lambda v: v.scope,
        )
        degradations = sorted(
            (
                DegradationView(
                    e.scope, e.level, e.small_pool, e.max_tokens_cap, Decided.of(e, now)
                )
                for e in self.control.all(DegradationLevel)
            ),
            key=lambda v: v.scope,
        )
        batch_limits = sorted(
            (
                BatchLimitView(e.scope, e.worker_id, e.limit, Decided.of(e, now))
                for e in self.control.all(BatchLimit)
            ),
            key=lambda v: v.scope,
        )
        steering: list[QuotaOverride | RegionThrottle] = [
            *self.control.all(QuotaOverride),
            *self.control.all(RegionThrottle),
        ]
        overrides = sorted(
            (
                OverrideView(e.scope, e.issuer, Decided.of(e, now))
                for e in steering
                if _steers(e, now)
            ),
            key=lambda v: v.scope,
        )
        breaker_of = {b.scope: b.state for b in breakers}
        level_of = {d.scope: d.level for d in degradations}
        return FleetStatus(
            now=now,
            window_s=window_s,
            stale_after_s=self.stale_after_s,
            workers=workers,
            pools=tuple(
                _pool(name, workers, level_of.get(f"pool:{name}"), breaker_of.get(f"pool:{name}"))
                for name in sorted({*pools, *(w.pool for w in workers)})
            ),
            breakers=tuple(breakers),
            degradations=tuple(degradations),
            batch_limits=tuple(batch_limits),
            overrides=tuple(overrides),
            groups=tuple(sorted(groups)),
            lags=lag,
            control_age_s=None if self._newest_issued is None else now - self._newest_issued,
            control_events=self.control_events,
            control_refused=self.refused,
            telemetry_events=sum(1 for at in self._telemetry_at if at >= since),
            invalid_records=self.invalid,
        )

    def _worker(self, worker_id: str, at: float, pool: str, now: float, since: float) -> WorkerView:
        heartbeat = _since(self._heartbeats.get(worker_id), since)
        engine = _since(self._engines.get(worker_id), since)
        gpus = sorted(
            (g for (w, _), g in self._gpus.items() if w == worker_id and g.at >= since),
            key=lambda g: g.gpu_index,
        )
        # Heartbeats and engine stats both carry the engine, in-flight count and batch
        # limit: the newer of the two wins.
        latest: WorkerHeartbeat | EngineStats | None = max(
            (e for e in (heartbeat, engine) if e is not None), key=lambda e: e.at, default=None
        )
        age = now - at
        stopped = heartbeat is not None and heartbeat.status == "stopped"
        return WorkerView(
            worker_id=worker_id,
            pool=pool,
            last_seen_s=age,
            alive=age <= self.stale_after_s and not stopped,
            status=None if heartbeat is None else heartbeat.status,
            engine=None if latest is None else latest.engine,
            in_flight=None if latest is None else latest.in_flight,
            running=None if engine is None else engine.running,
            waiting=None if engine is None else engine.waiting,
            kv_cache_usage=None if engine is None else engine.kv_cache_usage,
            batch_limit=None if latest is None else latest.batch_limit,
            gpus=tuple(
                GpuView(
                    index=g.gpu_index,
                    name=g.name,
                    utilization_pct=g.utilization_pct,
                    temperature_c=g.temperature_c,
                    memory_used_bytes=g.memory_used_bytes,
                    memory_total_bytes=g.memory_total_bytes,
                    simulated=g.simulated,
                )
                for g in gpus
            ),
        )


def _pool(
    name: str, workers: tuple[WorkerView, ...], degradation: int | None, breaker: str | None
) -> PoolView:
    mine = [w for w in workers if w.pool == name]
    alive = [w for w in mine if w.alive]
    return PoolView(
        pool=name,
        workers=len(mine),
        alive=len(alive),
        in_flight=sum(w.in_flight or 0 for w in alive),
        waiting=sum(w.waiting or 0 for w in alive),
        degradation=degradation,
        breaker=breaker,
    )
