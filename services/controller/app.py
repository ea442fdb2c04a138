"""The controller's shell: a faust-streaming app run inside our own process.

Flow: the ``route`` agent reads ``llm.telemetry``, dead-letters what cannot be decoded
and makes sure each record is decided by the instance that owns its pool: one controller
instance sees all of a pool's workers and decides for the pool and for them (scale-out
is faust's: more instances share the partitions). seawall's workers key their telemetry
by pool, so a record normally sits on its pool's partition already; faust assigns the
same partition of every topic with as many partitions to the same instance
(co-partitioning), so ``route`` decides such a record itself. Any other record (another
producer's key, or a telemetry topic with another partition count) is forwarded to the
app's internal topic ``<app id>-telemetry-by-pool``, keyed by pool, where the ``decide``
agent reads it. Deciding feeds the record to that pool's ``PoolDecider``; a timer task
evaluates every owned pool each ``controller_tick_s`` (holds advance and heartbeat loss
shows without telemetry) and re-publishes the decisions in force; a pool that got
telemetry is evaluated — the pool and the workers that sent it, not the whole pool
(``PoolDecider.react``) — as soon as the timer task is free (it rests
``controller_react_s`` between evaluations, or ``EVALUATION_REST`` times as long as the
last one took), so a threshold crossed is decided within one broker hop and that rest,
not at the next tick. Control events go to
``llm.control`` keyed by ``<kind>/<scope>``.

State: the ``decisions`` table (changelog-backed) holds each pool's ``PoolRecord`` under
the key ``<pool>`` and each of its workers' ``WorkerRecord`` under ``<pool>#<worker>``:
a change rewrites the records of the scopes it touched, never the whole pool, so the
changelog grows with the changes, not with changes × workers. A change is written to
the table and the changelog flushed *before* its control event is published, so a
restarted controller never restores a state older than one it published (which would
contradict it); the ``Outbox`` shares one flush among the decisions pending
together. Every key is partitioned by its pool alone (``partition_by_pool``, the faust
producer's partitioner), so a pool's records share the partition of the pool on the
internal topic and the table may be written from the timer as well as from the agent
(``use_partitioner``). The statistics windows
(DDSketch buckets) are not in a table: a changelog record per request would cost more
than the windows are worth after a restart, and they refill from fresh telemetry
within one window while the restored decisions hold.

No Kafka transactions (the embedded broker has none): at-least-once processing, and
``seq`` (latest wins) makes duplicates harmless.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import faust
from aiokafka.partitioner import DefaultPartitioner
from faust.types import StreamT
from pydantic import ValidationError

from schemas import ControlEvent, TelemetryEvent
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import close, ensure_topics
from seawall_client.serde import TELEMETRY, DecodeError, decode, encode
from seawall_client.topics import base_pool
from services.common.bus import make_producer, topics_of
from services.common.control import ControlFollower, ControlState
from services.common.deadletters import DeadLetters, failure_of
from services.common.failures import is_infrastructure
from services.common.lifecycle import Component, cancel_tasks, wait_set
from services.controller import metrics as m
from services.controller.alerting import conditions
from services.controller.canaries import CanaryReleases
from services.controller.decider.pool import Output, PoolDecider
from services.controller.decider.records import PoolRecord, WorkerRecord
from services.controller.notify import Email, Notifiers, Sender, SmtpConfig, Webhook
from services.controller.outbox import Outbox
from services.controller.policy.alerts import AlertBook, Reconciled
from services.controller.regions import RegionGuard
from services.controller.settings import ControllerSettings
from services.controller.transport import App

log = logging.getLogger(__name__)

EVALUATION_REST = 4.0
"""After an evaluation the timer task rests at least this many times as long as it took:
evaluating takes at most a fifth of the process, the rest is left to reading telemetry.
(Measured without it: at 1,000 workers in six pools, evaluations every 20 ms left the
controller deciding 459 records/s where it had decided 2,122.)"""
R = TypeVar("R", PoolRecord, WorkerRecord)


FLEET_KEY = "#fleet"
KEY_SEPARATOR = b"#"
"""Between the pool and the worker in a worker record's key (never in an ``Ident``)."""
_PARTITIONER = DefaultPartitioner()


def notifiers_of(settings: ControllerSettings) -> Notifiers:
    """The notifiers the settings configure (none: alerts are only published)."""
    senders: list[Sender] = []
    s = settings
    if s.alert_webhook_url:
        senders.append(
            Webhook(s.alert_webhook_url, s.alert_webhook_format, s.alert_notify_timeout_s)
        )
    if s.alert_smtp_host:
        password = s.alert_smtp_password
        smtp = SmtpConfig(
            host=s.alert_smtp_host,
            port=s.alert_smtp_port,
            sender=s.alert_email_from,
            recipients=s.alert_email_recipients,
            starttls=s.alert_smtp_starttls,
            user=s.alert_smtp_user,
            password=None if password is None else password.get_secret_value(),
            timeout_s=s.alert_notify_timeout_s,
        )
        senders.append(Email(smtp))
    return Notifiers(senders, attempts=s.alert_notify_attempts, retry_base_s=s.alert_notify_retry_s)


def pool_key(pool: str) -> bytes:
    return pool.encode()


def worker_key(pool: str, worker_id: str) -> bytes:
    return pool_key(pool) + KEY_SEPARATOR + worker_id.encode()


def partition_by_pool(key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
    """The faust producer's partitioner: a record's partition is its pool's, so the
    internal topic and every record of a pool in the changelog share one partition. A
    canary's pool shares its base pool's, so one instance holds both arms of the
    comparison."""
    pool = None
    if key is not None:
        name = key.partition(KEY_SEPARATOR)[0].decode(errors="surrogateescape")
        pool = base_pool(name).encode(errors="surrogateescape")
    partition: int = _PARTITIONER(pool, all_partitions, available)
    return partition


def build_app(settings: ControllerSettings, datadir: Path) -> faust.App:
    """The faust app: at-least-once, in-memory tables restored from their changelogs,
    no web server, no standby replicas (a new owner restores from the changelog), and
    our fetch wait (see ``transport``)."""
    session_s = settings.controller_session_timeout_s
    return App(
        settings.app_id,
        fetch_max_wait_ms=settings.consumer_fetch_max_wait_ms,
        broker=[f"kafka://{host.strip()}" for host in settings.kafka_bootstrap.split(",")],
        store="memory://",
        processing_guarantee="at_least_once",
        topic_partitions=settings.topic_partitions,
        topic_replication_factor=settings.topic_replication,
        table_standby_replicas=0,
        web_enabled=False,
        autodiscover=False,
        datadir=datadir,
        broker_session_timeout=session_s,
        broker_rebalance_timeout=session_s,
        broker_heartbeat_interval=min(3.0, session_s / 3),
        # A controller that starts for the first time has no use for old telemetry.
        consumer_auto_offset_reset="latest",
        producer_partitioner=partition_by_pool,
    )


class _InProcessWorker(faust.Worker):
    """faust's worker without its process-wide side effects: the signals belong to our
    lifecycle (``run_until_signalled``), the logging to ``services.common.logs``."""

    def __init__(self, app: faust.App) -> None:
        super().__init__(
            app, quiet=True, daemon=False, override_logging=False, redirect_stdouts=False
        )
        self.spinner = None

    def install_signal_handlers(self) -> None:
        """None: SIGTERM stops the ``Controller`` component, which stops this worker."""


class Controller(Component):
    name = "controller"

    def __init__(self, settings: ControllerSettings, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__()
        self.settings = settings
        self.clock = clock
        self.topics = topics_of(settings)
        self.config = settings.decider_config()
        self.deciders: dict[str, PoolDecider] = {}
        """The pools this instance owns now."""
        self._lock = asyncio.Lock()
        self._exporter = m.StateExporter(worker_signals=settings.controller_worker_signals)
        self._producer = make_producer(settings)
        self._dead_letters = DeadLetters(
            self._producer, self.topics.deadletter, "controller", clock
        )
        self._datadir = Path(tempfile.gettempdir()) / f"seawall-controller-{uuid.uuid4().hex}"
        self.app = build_app(settings, self._datadir)
        self._telemetry = self.app.topic(
            self.topics.telemetry,
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
        )
        self._by_pool = self.app.topic(
            f"{settings.app_id}-telemetry-by-pool",
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
            partitions=settings.topic_partitions,
            internal=True,
        )
        self._decisions = self.app.Table(
            "decisions",
            key_type=bytes,
            value_type=bytes,
            partitions=settings.topic_partitions,
            use_partitioner=True,
        )
        self.app.agent(self._telemetry, name="route")(self._route)
        self.app.agent(self._by_pool, name="decide")(self._decide)
        self._worker = _InProcessWorker(self.app)
        self._ticker: asyncio.Task[Any] | None = None
        self._touched: set[str] = set()
        """Pools that got telemetry since their last evaluation."""
        self._telemetry_seen = asyncio.Event()
        self._outbox = Outbox(flush=lambda: self.app.producer.flush(), send=self._send)
        self._direct = False
        """Whether ``route`` may decide records on their pool's partition itself."""
        self._pool_partitions: dict[str, int] = {}
        self._publisher: asyncio.Task[Any] | None = None
        self._alerts = AlertBook(settings.alert_config())
        self.control = ControlState(clock)
        """The control topic as every instance reads it (operators' commands, the
        decisions of every instance)."""
        self._follower = ControlFollower(settings, self.topics.control, self.control)
        self.regions = RegionGuard(settings, self.owns_fleet, self.control, clock)
        self.canaries = CanaryReleases(
            valid_for_s=settings.controller_valid_for_s,
            republish_s=settings.controller_republish_s,
            check_timeout_s=settings.controller_canary_check_timeout_s,
        )
        self._notifiers = notifiers_of(settings)

    # -- lifecycle -------------------------------------------------------------
    async def on_start(self) -> None:
        await ensure_topics(
            self.settings.kafka_bootstrap, self.topics.specs(), self.settings.topic_replication
        )
        await self._producer.start()
        # Co-partitioned with the internal topic only with as many partitions.
        telemetry_partitions = await self._producer.partitions_for(self.topics.telemetry)
        self._direct = len(telemetry_partitions) == self.settings.topic_partitions
        if not self._direct:
            log.warning(
                "the telemetry topic's partitions differ from the controller's: every "
                "record takes the internal topic",
                extra={
                    "telemetry_partitions": len(telemetry_partitions),
                    "topic_partitions": self.settings.topic_partitions,
                },
            )
        try:
            await self._worker.start()
        finally:
            # faust makes its data directory when it starts; the memory store never uses
            # it, so nothing is left behind, not even by a killed controller.
            shutil.rmtree(self._datadir, ignore_errors=True)
        self._publisher = self.spawn(self._outbox.run(), "publish")
        self._notifiers.start()
        await self._follower.start()
        await self.regions.start()
        self.spawn(self._watch_regions(), "watch:regions")
        self._ticker = self.spawn(self._tick_loop(), "tick")
        log.info(
            "controller started",
            extra={
                "app_id": self.settings.app_id,
                "time_scale": self.settings.controller_time_scale,
            },
        )

    async def on_stop(self) -> None:
        if self._ticker is not None:
            await cancel_tasks({self._ticker})
        await self.regions.stop()
        await self._follower.stop()
        try:
            await self._worker.stop()  # agents finish their record; offsets are committed
            if self._publisher is not None:
                await cancel_tasks({self._publisher})
            # Stopping faust stopped (and so flushed) the changelog's producer.
            await self._outbox.drain(durable=True)
        finally:
            await self._notifiers.stop()
            await close(self._producer)

    @property
    def ready(self) -> bool:
        """Recovered and not rebalancing: the table holds what this instance owns."""
        app = self.app
        recovery = app.tables.recovery  # type: ignore[attr-defined]
        return bool(recovery.completed.is_set()) and not app.rebalancing and not app.in_recovery

    # -- agents ----------------------------------------------------------------
    async def _route(self, stream: StreamT[bytes]) -> None:
        async for event in stream.events():
            message = event.message
            try:
                telemetry = decode(TELEMETRY, event.value)
            except DecodeError as e:
                m.TELEMETRY.labels("unknown", "invalid").inc()
                await self._dead_letter(message, event.value, e)
                continue
            if self._direct and message.partition == self._partition(telemetry.pool):
                await self._observe(telemetry, message, event.value)  # on its pool's partition
            else:
                await self._by_pool.send(key=telemetry.pool.encode(), value=event.value)

    async def _decide(self, stream: StreamT[bytes]) -> None:
        async for event in stream.events():
            try:
                telemetry = decode(TELEMETRY, event.value)
            except DecodeError as e:  # only the route agent writes here; never expected
                log.error(
                    "skipped an invalid record of the internal topic", extra={"reason": e.reason}
                )
                continue
            await self._observe(telemetry, event.message, event.value)

    async def _observe(self, telemetry: TelemetryEvent, message: Any, value: bytes) -> None:
        """Decide one record. One that the policy code cannot take (a bug, or values no
        test foresaw) is dead-lettered, never allowed to stop the agent; only the
        broker being unavailable is raised (faust then restarts the agent)."""
        try:
            async with self._lock:
                now = self.clock.time()
                decider = self._decider(telemetry.pool, now)
                output = decider.observe(telemetry, now)
                await self._publish(decider, output)
                self._touched.add(telemetry.pool)
                self._telemetry_seen.set()
        except Exception as e:
            if is_infrastructure(e):
                raise
            log.error("a telemetry record failed", extra={"error": type(e).__name__})
            m.TELEMETRY.labels(telemetry.type, "failed").inc()
            await self._dead_letter(message, value, e)
            return
        m.count_output(telemetry.type, output)

    async def _dead_letter(self, message: Any, value: bytes | None, error: Exception) -> None:
        reason, text = failure_of(error)
        await self._dead_letters.send(
            source_topic=message.topic,
            partition=message.partition,
            offset=message.offset,
            key=message.key,
            value=value,
            reason=reason,
            error=text,
        )

    # -- timer -----------------------------------------------------------------
    async def _tick_loop(self) -> None:
        """Evaluate the pools that got telemetry once the timer task is free, and every
        owned pool each ``controller_tick_s``. Each kind of evaluation rests in
        proportion to its own cost (``EVALUATION_REST`` times as long as it took), so
        that evaluating never takes more than a small share of the process from reading
        telemetry: after a reaction the timer rests that long (at least
        ``controller_react_s``); after a full tick only ``controller_react_s``, but the
        next full tick waits that long — a 1,000-worker tick takes a quarter of a second,
        and resting four times that before any reaction held every reaction for a
        second."""
        settings = self.settings
        next_tick = time.monotonic() + settings.controller_tick_s
        while True:
            await wait_set(self._telemetry_seen, max(0.0, next_tick - time.monotonic()))
            self._telemetry_seen.clear()
            if self._worker.crashed or self.app.crashed:
                reason = self.app.crash_reason or self._worker.crash_reason
                raise RuntimeError(f"the faust app crashed: {reason!r}")
            touched, self._touched = self._touched, set()
            started = time.monotonic()
            full = started >= next_tick
            if self.ready:
                await (self.tick() if full else self.evaluate(touched))
            finished = time.monotonic()
            took = finished - started
            if full:
                next_tick = max(
                    started + settings.controller_tick_s, finished + EVALUATION_REST * took
                )
            rest = 0.0 if full else EVALUATION_REST * took
            await asyncio.sleep(max(settings.controller_react_s, rest))

    async def tick(self) -> None:
        """Evaluate every pool this instance owns (adopting those it newly owns)."""
        started = time.monotonic()
        async with self._lock:
            self._adopt_owned_pools(self.clock.time())
        await self._evaluate(list(self.deciders), full=True)
        async with self._lock:
            now = self.clock.time()
            splits = self.canaries.evaluate(self.control, self.deciders, self.owns_pool, now)
            found = [c for decider in self.deciders.values() for c in conditions(decider)]
            found += self.regions.conditions()
            found += self.canaries.conditions()
            fleet = self.owns_fleet()
            alerts = self._alerts.reconcile(
                found, now, owned=lambda pool: pool in self.deciders if pool else fleet
            )
            notes = self._alerts.due(now)
            self._exporter.export(self.deciders.values(), self._alerts.active())
        await self._send(splits)
        await self._send_alerts(alerts)
        self._notifiers.submit(notes)
        m.TICK_SECONDS.set(time.monotonic() - started)

    async def evaluate(self, pools: Iterable[str]) -> None:
        """React in these pools, those of them this instance owns: each pool and its
        workers that sent telemetry (``PoolDecider.react``)."""
        await self._evaluate(pools, full=False)

    async def _evaluate(self, pools: Iterable[str], *, full: bool) -> None:
        """One pool at a time, each under the lock: the agents decide records between
        two pools rather than waiting for all of them."""
        for pool in pools:
            async with self._lock:
                decider = self.deciders.get(pool)  # it may have moved meanwhile
                if decider is None:
                    continue
                now = self.clock.time()
                output = decider.tick(now) if full else decider.react(now)
                await self._publish(decider, output)
            m.count_output(None, output)

    # -- pools -----------------------------------------------------------------
    def _partition(self, pool: str) -> int:
        """The partition of a pool, as the producer's partitioner picks it for the
        internal topic and the changelog alike (remembered: ``route`` asks per record)."""
        partition = self._pool_partitions.get(pool)
        if partition is None:
            partitions = list(range(self.settings.topic_partitions))
            partition = partition_by_pool(pool_key(pool), partitions, partitions)
            self._pool_partitions[pool] = partition
        return partition

    def _owned_partitions(self) -> set[int]:
        topic = self._by_pool.get_topic_name()
        return {tp.partition for tp in self.app.assignor.assigned_actives() if tp.topic == topic}

    def owns_pool(self, pool: str) -> bool:
        """Whether this instance decides for ``pool`` (and its canaries') now."""
        return self.ready and self._partition(pool) in self._owned_partitions()

    def owns_fleet(self) -> bool:
        """Whether this instance makes the fleet-wide decisions (hotspot throttles):
        the one that owns the partition of the key ``#fleet`` (never a pool's name)."""
        return self.owns_pool(FLEET_KEY)

    async def _watch_regions(self) -> None:
        """Fail with the region guard: the process exits and its supervisor restarts it."""
        await self.regions.failed.wait()
        raise RuntimeError("the region guard failed") from self.regions.failure

    def _adopt_owned_pools(self, now: float) -> None:
        owned = self._owned_partitions()
        for pool in [p for p in self.deciders if self._partition(p) not in owned]:
            log.info("pool moved to another controller instance", extra={"pool": pool})
            del self.deciders[pool]
        for key in list(self._decisions):
            if KEY_SEPARATOR in key:
                continue  # a worker's record: restored with its pool's
            pool = key.decode()
            if pool not in self.deciders and self._partition(pool) in owned:
                self._decider(pool, now)

    def _decider(self, pool: str, now: float) -> PoolDecider:
        decider = self.deciders.get(pool)
        if decider is not None:
            return decider
        record = self._restored(PoolRecord, pool_key(pool))
        workers: list[WorkerRecord] = []
        if record is not None:
            prefix = pool_key(pool) + KEY_SEPARATOR
            for key in [k for k in self._decisions if k.startswith(prefix)]:
                worker = self._restored(WorkerRecord, key)
                if worker is not None:
                    workers.append(worker)
        decider = self.deciders[pool] = PoolDecider(pool, self.config, now, record, workers)
        log.info(
            "pool restored" if record is not None else "pool first seen",
            extra={"pool": pool, "workers": len(workers), "decisions": len(decider.in_force)},
        )
        return decider

    def _restored(self, kind: type[R], key: bytes) -> R | None:
        """The record under ``key``, if there is one and it can be read (one that cannot
        is logged and left out: its scope starts afresh)."""
        raw = self._decisions.get(key)
        if raw is None:
            return None
        try:
            return kind.model_validate_json(raw)
        except ValidationError as e:
            log.error(
                "unreadable record: its scope starts afresh",
                extra={"key": key.decode(errors="replace"), "error": str(e)[:500]},
            )
            return None

    async def _publish(self, decider: PoolDecider, output: Output) -> None:
        records = decider.take_records()
        if records.pool is not None:
            self._decisions[pool_key(decider.pool)] = encode(records.pool)
        for worker_id, worker in records.workers.items():
            key = worker_key(decider.pool, worker_id)
            if worker is not None:
                self._decisions[key] = encode(worker)
            elif key in self._decisions:
                del self._decisions[key]  # a tombstone in the changelog
        for event in output.changes:
            log.info(
                "decision",
                extra={
                    "key": event.control_key,
                    "seq": event.seq,
                    "reason": event.evidence.reason,
                },
            )
        # Published once the changelog holds their records (a change always writes its
        # scope's record): a restart must never restore a state older than one already
        # published. The outbox shares that flush among the decisions pending together.
        await self._outbox.put(output.events, flush_first=bool(output.changes))

    async def _send_alerts(self, alerts: Reconciled) -> None:
        """Publish alert records (not through the outbox: nothing is restored from
        them, the book re-derives them from the pools' state after a restart)."""
        for alert in alerts.changes:
            log.log(
                logging.INFO if alert.status == "resolved" else logging.WARNING,
                "alert",
                extra={
                    "rule": alert.rule,
                    "scope": alert.scope,
                    "status": alert.status,
                    "severity": alert.severity,
                    "count": alert.count,
                    "reason": alert.evidence.reason,
                },
            )
        sends = [
            await self._producer.send(
                self.topics.alerts, encode(alert), key=alert.fingerprint.encode()
            )
            for alert in alerts.records
        ]
        await asyncio.gather(*sends)
        m.ALERTS_FIRING.set(len(self._alerts.active()))

    async def _send(self, events: Sequence[ControlEvent]) -> None:
        sends = [
            await self._producer.send(
                self.topics.control, encode(event), key=event.control_key.encode()
            )
            for event in events
        ]
        await asyncio.gather(*sends)
