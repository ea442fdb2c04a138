"""The controller's timer task: reactions to fresh telemetry and the full tick.

A timer task evaluates every owned pool each ``controller_tick_s`` (holds advance and
heartbeat loss shows without telemetry) and re-publishes the decisions in force; a pool
that got telemetry is evaluated — the pool and the workers that sent it, not the whole
pool (``PoolDecider.react``) — as soon as the timer task is free (it rests
``controller_react_s`` between evaluations, or ``EVALUATION_REST`` times as long as the
last one took), so a threshold crossed is decided within one broker hop and that rest,
not at the next tick. The full tick also evaluates the canary releases, reconciles the
alerts (published to ``llm.alerts`` and handed to the notifiers) and exports the
pools' state as metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

import faust
from aiokafka import AIOKafkaProducer

from schemas import ControlEvent
from seawall_client.clock import Clock
from seawall_client.serde import encode
from seawall_client.topics import Topics
from services.common.control_state import ControlState
from services.common.lifecycle import wait_set
from services.controller import metrics as m
from services.controller.alerting import conditions
from services.controller.canaries import CanaryReleases
from services.controller.notify import Notifiers
from services.controller.policy.alerts import AlertBook, Reconciled
from services.controller.pools import Pools
from services.controller.regions import RegionGuard
from services.controller.settings import ControllerSettings

log = logging.getLogger(__name__)

EVALUATION_REST = 4.0
"""After an evaluation the timer task rests at least this many times as long as it took:
evaluating takes at most a fifth of the process, the rest is left to reading telemetry.
(Measured without it: at 1,000 workers in six pools, evaluations every 20 ms left the
controller deciding 459 records/s where it had decided 2,122.)"""


class Ticker:
    """The timer task's evaluations, under the lock the agents decide under."""

    def __init__(
        self,
        settings: ControllerSettings,
        pools: Pools,
        worker: faust.Worker,
        lock: asyncio.Lock,
        control: ControlState,
        regions: RegionGuard,
        canaries: CanaryReleases,
        notifiers: Notifiers,
        producer: AIOKafkaProducer,
        topics: Topics,
        send: Callable[[Sequence[ControlEvent]], Awaitable[None]],
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._pools = pools
        self._worker = worker
        self._lock = lock
        self.control = control
        self.regions = regions
        self.canaries = canaries
        self._notifiers = notifiers
        self._producer = producer
        self.topics = topics
        self._send = send
        self._exporter = m.StateExporter(worker_signals=settings.controller_worker_signals)
        self._alerts = AlertBook(settings.alert_config())
        self._touched: set[str] = set()
        """Pools that got telemetry since their last evaluation."""
        self._telemetry_seen = asyncio.Event()

    def touch(self, pool: str) -> None:
        """``pool`` got telemetry: react in it as soon as the timer task is free."""
        self._touched.add(pool)
        self._telemetry_seen.set()

    async def run(self) -> None:
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
        app = self._pools.app
        next_tick = time.monotonic() + settings.controller_tick_s
        while True:
            await wait_set(self._telemetry_seen, max(0.0, next_tick - time.monotonic()))
            self._telemetry_seen.clear()
            if self._worker.crashed or app.crashed:
                reason = app.crash_reason or self._worker.crash_reason
                raise RuntimeError(f"the faust app crashed: {reason!r}")
            touched, self._touched = self._touched, set()
            started = time.monotonic()
            full = started >= next_tick
            if self._pools.ready:
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
        pools = self._pools
        async with self._lock:
            pools.adopt_owned_pools(self.clock.time())
        await self._evaluate(list(pools.deciders), full=True)
        async with self._lock:
            now = self.clock.time()
            splits = self.canaries.evaluate(self.control, pools.deciders, pools.owns_pool, now)
            found = [c for decider in pools.deciders.values() for c in conditions(decider)]
            found += self.regions.conditions()
            found += self.canaries.conditions()
            fleet = pools.owns_fleet()
            alerts = self._alerts.reconcile(
                found, now, owned=lambda pool: pool in pools.deciders if pool else fleet
            )
            notes = self._alerts.due(now)
            self._exporter.export(pools.deciders.values(), self._alerts.active())
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
                decider = self._pools.deciders.get(pool)  # it may have moved meanwhile
                if decider is None:
                    continue
                now = self.clock.time()
                output = decider.tick(now) if full else decider.react(now)
                await self._pools.publish(decider, output)
            m.count_output(None, output)

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
