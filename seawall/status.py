"""``seawall status``: the fleet at a glance, for operators.

Pure part: ``StatusFold`` folds telemetry and control records, as read from the broker,
into a ``FleetStatus`` at an injected ``now``: the workers heard from in the telemetry
window (alive, or stale once silent longer than the controller's heartbeat timeout),
the pools, the decisions in force (breakers, degradation levels, batch limits: per
``<kind>/<scope>`` the highest ``seq`` wins, applied by the ``ControlState`` every
consumer uses) and how old the newest decision is. ``lags`` turns committed and end
offsets into consumer-group lags.

Shell part: ``collect`` reads the whole control topic and the telemetry topic from
``window_s`` ago, with no consumer group (it changes nothing on the broker), up to the
end offsets seen when it started, so that it returns promptly on empty and busy topics
alike; then the committed offsets of the fleet's consumer groups; all within
``timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from schemas import (
    BatchLimit,
    BreakerState,
    ControlEvent,
    DegradationLevel,
    EngineStats,
    GpuStats,
    WorkerHeartbeat,
)
from seawall.events import describe, expired
from services.common.bus import make_consumer, topics_of
from services.common.control import ControlState
from services.common.serde import CONTROL, TELEMETRY, DecodeError, decode
from services.common.settings import CommonSettings
from services.common.topics import Topics
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
    index: int
    name: str
    utilization_pct: float
    temperature_c: float
    memory_used_bytes: int
    memory_total_bytes: int
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
    groups: tuple[str, ...]
    """The fleet's consumer groups known to the broker, with or without commits."""
    lags: tuple[TopicLag, ...]
    control_age_s: float | None
    """Seconds since the newest control event was issued; ``None``: none was read. The
    controller re-publishes the decisions in force every few seconds, so an age that
    keeps growing means it has fallen silent."""
    control_events: int
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
        self.control = ControlState()
        self.control_events = 0
        self.invalid = 0
        self._newest_issued: float | None = None
        self._seen: dict[str, tuple[float, str]] = {}
        """Per worker: the ``at`` and pool of its newest telemetry of any type."""
        self._heartbeats: dict[str, WorkerHeartbeat] = {}
        self._engines: dict[str, EngineStats] = {}
        self._gpus: dict[tuple[str, int], GpuStats] = {}
        self._telemetry_at: list[float] = []

    def feed_control(self, raw: bytes | None) -> None:
        try:
            event = decode(CONTROL, raw)
        except DecodeError:
            self.invalid += 1
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
        if isinstance(event, WorkerHeartbeat):
            _keep_newest(self._heartbeats, event.worker_id, event)
        elif isinstance(event, EngineStats):
            _keep_newest(self._engines, event.worker_id, event)
        elif isinstance(event, GpuStats):
            _keep_newest(self._gpus, (event.worker_id, event.gpu_index), event)
        # A RequestCompleted only tells that its worker was heard from.

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
            groups=tuple(sorted(groups)),
            lags=lag,
            control_age_s=None if self._newest_issued is None else now - self._newest_issued,
            control_events=self.control_events,
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


# -- rendering ----------------------------------------------------------------------


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if abs(seconds) < 120:
        return f"{seconds:.1f}s ago"
    if abs(seconds) < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.0f}h ago"


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _when_decided(decided: Decided) -> str:
    text = _ago(decided.age_s)
    return f"[red]{text} (expired)[/]" if decided.expired else text


def _workers(status: FleetStatus) -> Table:
    table = _table(
        "workers", "worker", "pool", "state", "seen", "in flight", "run/wait", "KV", "limit", "GPUs"
    )
    for w in status.workers:
        state = "[green]alive[/]" if w.alive else "[red]stale[/]"
        if w.status not in (None, "serving"):
            state += f" ({w.status})"
        gpus = ", ".join(
            f"{g.index}: {g.temperature_c:.0f}°C {g.utilization_pct:.0f}%"
            + (" sim" if g.simulated else "")
            for g in w.gpus
        )
        table.add_row(
            escape(w.worker_id),
            escape(w.pool),
            state,
            _ago(w.last_seen_s),
            _opt(w.in_flight),
            "-" if w.running is None else f"{w.running}/{w.waiting}",
            "-" if w.kv_cache_usage is None else f"{w.kv_cache_usage:.0%}",
            _opt(w.batch_limit),
            escape(gpus) or "-",
        )
    return table


def _pools(status: FleetStatus) -> Table:
    table = _table(
        "pools", "pool", "workers alive", "in flight", "waiting", "degradation", "breaker"
    )
    for p in status.pools:
        table.add_row(
            escape(p.pool),
            f"{p.alive}/{p.workers}",
            str(p.in_flight),
            str(p.waiting),
            _opt(p.degradation),
            _opt(p.breaker),
        )
    return table


def _decisions(title: str, rows: Iterable[tuple[str, Decided]]) -> Table:
    """Breakers or degradation levels: scope, state, when, why."""
    table = _table(title, "scope", "state", "decided", "reason")
    for scope, decided in rows:
        table.add_row(
            escape(scope),
            escape(decided.summary),
            _when_decided(decided),
            escape(decided.reason),
        )
    return table


def _batch_limits(status: FleetStatus) -> Table:
    reported = {w.worker_id: w.batch_limit for w in status.workers}
    table = _table("batch limits", "worker", "limit", "reported", "decided", "reason")
    for b in status.batch_limits:
        table.add_row(
            escape(b.worker_id),
            str(b.limit),
            _opt(reported.get(b.worker_id)),
            _when_decided(b.decided),
            escape(b.decided.reason),
        )
    return table


def _lags(status: FleetStatus) -> Table:
    table = _table("consumer lag", "group", "topic", "partitions", "committed", "end", "lag")
    for x in status.lags:
        table.add_row(
            escape(x.group),
            escape(x.topic),
            *(str(n) for n in (x.partitions, x.committed, x.end, x.lag)),
        )
    committing = {x.group for x in status.lags}
    for group in status.groups:
        if group not in committing:
            table.add_row(escape(group), "[dim](nothing committed)[/]", "", "", "", "")
    return table


def render(status: FleetStatus, console: Console) -> None:
    """The status as rich tables."""
    console.print(
        f"telemetry: last {status.window_s:g}s, {status.telemetry_events} records · "
        f"control state: newest decision {_ago(status.control_age_s)} "
        f"({status.control_events} events read)",
        highlight=False,
    )
    if status.invalid_records:
        console.print(f"[yellow]skipped {status.invalid_records} undecodable records[/]")
    tables = (
        _workers(status),
        _pools(status),
        _decisions("breakers", ((b.scope, b.decided) for b in status.breakers)),
        _decisions("degradation", ((d.scope, d.decided) for d in status.degradations)),
        _batch_limits(status),
        _lags(status),
    )
    for table in tables:
        console.print(table if table.row_count else f"[dim]{table.title}: none[/]")


# -- shell --------------------------------------------------------------------------


class StatusError(Exception):
    """The fleet could not be read; the message tells the operator why."""


def _partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    return [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]


async def _read_topics(
    consumer: AIOKafkaConsumer, topics: Topics, fold: StatusFold, since: float
) -> None:
    """Feed ``fold`` the whole control topic and the telemetry from ``since`` on, up to
    the end offsets of now (whole record batches: Tansu's end offset is the first offset
    of a partition's last batch plus one)."""
    control = _partitions(consumer, topics.control)
    telemetry = _partitions(consumer, topics.telemetry)
    consumer.assign([*control, *telemetry])
    await consumer.seek_to_beginning(*control)
    ends: dict[TopicPartition, int] = await consumer.end_offsets([*control, *telemetry])
    since_ms = int(since * 1000)
    starts = await consumer.offsets_for_times({tp: since_ms for tp in telemetry})
    for tp in telemetry:
        found = starts.get(tp)
        # No record that recent: Kafka answers None, Tansu offset 0 with timestamp -1.
        recent = found is not None and found.timestamp >= since_ms
        consumer.seek(tp, found.offset if recent else ends[tp])
    while True:
        pending = [tp for tp in ends if await consumer.position(tp) < ends[tp]]
        if not pending:
            return
        batches = await consumer.getmany(*pending, timeout_ms=200)
        for tp, records in batches.items():
            feed = fold.feed_control if tp.topic == topics.control else fold.feed_telemetry
            for record in records:
                feed(record.value)


async def _committed(
    settings: CommonSettings, partitions: list[TopicPartition]
) -> dict[str, dict[TopicPartition, int]]:
    """The fleet's consumer groups (``<prefix>seawall…``) and their committed offsets
    among ``partitions``."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.kafka_bootstrap, client_id=f"seawall-{settings.instance_id}"
    )
    await admin.start()
    try:
        stem = f"{settings.topic_prefix}{GROUP_STEM}"
        groups = sorted(g for g, *_ in await admin.list_consumer_groups() if g.startswith(stem))
        committed: dict[str, dict[TopicPartition, int]] = {}
        for group in groups:
            # Named partitions: Tansu answers a request for "all of them" with a response
            # aiokafka cannot parse.
            offsets = await admin.list_consumer_group_offsets(group, partitions=partitions)
            committed[group] = {tp: o.offset for tp, o in offsets.items() if o.offset >= 0}
        return committed
    finally:
        await admin.close()


async def _collect(settings: CommonSettings, window_s: float, stale_after_s: float) -> FleetStatus:
    topics = topics_of(settings)
    consumer = make_consumer(settings, group_id=None)
    try:
        try:
            await consumer.start()
        except KafkaError as e:
            raise StatusError(f"no broker answered at {settings.kafka_bootstrap}: {e}") from None
        existing = await consumer.topics()
        missing = [t for t in (topics.telemetry, topics.control) if t not in existing]
        if missing:
            raise StatusError(
                f"no topic {', '.join(missing)} on {settings.kafka_bootstrap} (is the stack "
                "up? check SEAWALL_KAFKA_BOOTSTRAP and SEAWALL_TOPIC_PREFIX)"
            )
        # Before ``assign``: from then on the metadata holds only the assigned topics. The
        # telemetry and control topics carry the prefix: never an empty list.
        ours = [
            tp
            for topic in sorted(existing)
            if topic.startswith(settings.topic_prefix) and not topic.startswith("__")
            for tp in _partitions(consumer, topic)
        ]
        fold = StatusFold(stale_after_s)
        await _read_topics(consumer, topics, fold, time.time() - window_s)
        committed = await _committed(settings, ours)
        held = sorted({tp for offsets in committed.values() for tp in offsets})
        ends = await consumer.end_offsets(held) if held else {}
        groups = list(committed)
        return fold.result(time.time(), window_s, settings.pools, groups, lags(committed, ends))
    finally:
        await consumer.stop()


async def collect(
    settings: CommonSettings,
    window_s: float,
    timeout_s: float,
    stale_after_s: float = STALE_AFTER_S,
) -> FleetStatus:
    """Read the fleet's status from the broker; ``StatusError`` if it cannot be read
    within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _collect(settings, window_s, stale_after_s)
    except TimeoutError:
        raise StatusError(
            f"the broker at {settings.kafka_bootstrap} did not give the fleet's status "
            f"within {timeout_s:g}s"
        ) from None
    except KafkaError as e:
        raise StatusError(f"the broker at {settings.kafka_bootstrap} failed: {e}") from None


def run_status(
    settings: CommonSettings,
    window_s: float,
    as_json: bool,
    timeout_s: float,
    console: Console,
) -> int:
    """Print the fleet's status as tables or one JSON document; the exit status: 0 done,
    1 no broker, no fleet topics, or no answer in time."""
    try:
        status = asyncio.run(collect(settings, window_s, timeout_s))
    except StatusError as e:
        console.print(f"[red]{escape(str(e))}[/]", highlight=False)
        return 1
    if as_json:
        console.out(status.to_json(), highlight=False)
    else:
        render(status, console)
    return 0
