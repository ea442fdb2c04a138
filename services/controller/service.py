"""The controller's shell: a faust-streaming app run inside our own process.

This module owns the clients (the producer, the faust app and its worker) and the
lifecycle, and wires the parts, one module each:

- *the faust app* (``faust_app``): the app, its topics and its ``decisions`` table, and
  the worker that runs it here.
- *telemetry* (``telemetry``): the ``route`` agent reads ``llm.telemetry`` and decides
  each record on its pool's partition, or forwards it to the internal topic where the
  ``decide`` agent does; deciding feeds the record to its pool's ``PoolDecider``.
- *the timer* (``ticks``): reactions in the pools that got telemetry, and every
  ``controller_tick_s`` a full tick (every owned pool, canary releases, alerts).
- *pools* (``pools``): which pools this instance owns, their deciders restored from
  the table, and their records written back.
- *the outbox* (``outbox``): control events go to ``llm.control`` keyed by
  ``<kind>/<scope>``, each once the changelog holds its record.
- *regions* (``regions``), *canaries* (``canaries``) and alert *notifications*
  (``notify``).

State: the ``decisions`` table (changelog-backed) holds each pool's ``PoolRecord`` under
the key ``<pool>`` and each of its workers' ``WorkerRecord`` under ``<pool>#<worker>``
(``keys``): a change rewrites the records of the scopes it touched, never the whole
pool, so the changelog grows with the changes, not with changes × workers. A change is
written to the table and the changelog flushed *before* its control event is published,
so a restarted controller never restores a state older than one it published (which
would contradict it); the ``Outbox`` shares one flush among the decisions pending
together. Every key is partitioned by its pool alone (``partition_by_pool``, the faust
producer's partitioner), so a pool's records share the partition of the pool on the
internal topic and the table may be written from the timer as well as from the agent
(``use_partitioner``). The statistics windows (DDSketch buckets) are not in a table: a
changelog record per request would cost more than the windows are worth after a
restart, and they refill from fresh telemetry within one window while the restored
decisions hold.

No Kafka transactions (the embedded broker has none): at-least-once processing, and
``seq`` (latest wins) makes duplicates harmless.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from schemas import ControlEvent
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import close, ensure_topics
from services.common.bus import doorbell_for, make_producer, topics_of
from services.common.control import ControlFollower
from services.common.control_signing import send_signed, signer_for
from services.common.control_state import ControlState
from services.common.deadletters import DeadLetters
from services.common.hop_signing import hop_key_for
from services.common.lifecycle import Component, cancel_tasks
from services.controller.canaries import CanaryReleases
from services.controller.faust_app import InProcessWorker, build_app, channels_of
from services.controller.notify import Email, Notifiers, Sender, SmtpConfig, Webhook
from services.controller.outbox import Outbox
from services.controller.pools import Pools
from services.controller.regions import RegionGuard
from services.controller.settings import ControllerSettings
from services.controller.telemetry import TelemetryAgents
from services.controller.ticks import Ticker

log = logging.getLogger(__name__)

FRESH_S = 1.0
"""A control event issued less than this ago is a new decision (a re-publication keeps
its decision's ``issued_at``): only those ring the doorbell."""


def notifiers_of(settings: ControllerSettings) -> Notifiers:
    """The notifiers the settings configure (none: alerts are only published)."""
    senders: list[Sender] = []
    s = settings
    if s.alert_webhook_url is not None and s.alert_webhook_url.get_secret_value().strip():
        url = SecretStr(s.alert_webhook_url.get_secret_value().strip())
        senders.append(Webhook(url, s.alert_webhook_format, s.alert_notify_timeout_s))
    if s.alert_smtp_host:
        smtp = SmtpConfig(
            host=s.alert_smtp_host,
            port=s.alert_smtp_port,
            sender=s.alert_email_from,
            recipients=s.alert_email_recipients,
            starttls=s.alert_smtp_starttls,
            user=s.alert_smtp_user,
            password=s.alert_smtp_password,
            timeout_s=s.alert_notify_timeout_s,
        )
        senders.append(Email(smtp))
    return Notifiers(senders, attempts=s.alert_notify_attempts, retry_base_s=s.alert_notify_retry_s)


class Controller(Component):
    name = "controller"

    def __init__(self, settings: ControllerSettings, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__()
        self.settings = settings
        self.clock = clock
        self.topics = topics_of(settings)
        lock = asyncio.Lock()
        # Its control events ring the doorbell only when they change something (``_send``):
        # a decision re-published while in force need not wake every follower.
        self._doorbell = doorbell_for(settings)
        self._producer = make_producer(settings, delivered=None)
        self._signer = signer_for(settings, "controller")
        dead_letters = DeadLetters(self._producer, self.topics.deadletter, "controller", clock)
        self._datadir = Path(tempfile.gettempdir()) / f"seawall-controller-{uuid.uuid4().hex}"
        self.app = build_app(settings, self._datadir)
        channels = channels_of(self.app, settings, self.topics.telemetry)
        self._worker = InProcessWorker(self.app)
        self._outbox = Outbox(flush=lambda: self.app.producer.flush(), send=self._send)
        self.pools = Pools(
            self.app,
            channels.decisions,
            channels.by_pool,
            settings.decider_config(),
            settings.topic_partitions,
            self._outbox,
        )
        self._publisher: asyncio.Task[Any] | None = None
        self.control = ControlState(clock)
        """The control topic as every instance reads it (operators' commands, the
        decisions of every instance)."""
        self._follower = ControlFollower(settings, self.topics.control, self.control)
        self.regions = RegionGuard(settings, self.pools.owns_fleet, self.control, clock)
        self.canaries = CanaryReleases(
            valid_for_s=settings.controller_valid_for_s,
            republish_s=settings.controller_republish_s,
            check_timeout_s=settings.controller_canary_check_timeout_s,
        )
        self._notifiers = notifiers_of(settings)
        self.ticker = Ticker(
            settings,
            self.pools,
            self._worker,
            lock,
            self.control,
            self.regions,
            self.canaries,
            self._notifiers,
            self._producer,
            self.topics,
            self._send,
            clock,
        )
        self._ticking: asyncio.Task[Any] | None = None
        self._agents = TelemetryAgents(
            self.pools,
            channels.by_pool,
            self.ticker,
            dead_letters,
            lock,
            clock,
            hop=hop_key_for(settings, "telemetry"),
        )
        self.app.agent(channels.telemetry, name="route")(self._agents.route)
        self.app.agent(channels.by_pool, name="decide")(self._agents.decide)

    # -- lifecycle -------------------------------------------------------------
    async def on_start(self) -> None:
        await ensure_topics(self.settings.kafka, self.topics.specs())
        await self._producer.start()
        # Co-partitioned with the internal topic only with as many partitions.
        telemetry_partitions = await self._producer.partitions_for(self.topics.telemetry)
        self._agents.direct = len(telemetry_partitions) == self.settings.topic_partitions
        if not self._agents.direct:
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
        self._ticking = self.spawn(self.ticker.run(), "tick")
        log.info(
            "controller started",
            extra={
                "app_id": self.settings.app_id,
                "time_scale": self.settings.controller_time_scale,
            },
        )

    async def on_stop(self) -> None:
        if self._ticking is not None:
            await cancel_tasks({self._ticking})
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

    async def _watch_regions(self) -> None:
        """Fail with the region guard: the process exits and its supervisor restarts it."""
        await self.regions.failed.wait()
        raise RuntimeError("the region guard failed") from self.regions.failure

    async def _send(self, events: Sequence[ControlEvent]) -> None:
        await send_signed(self._producer, self.topics.control, events, self._signer)
        if self._doorbell is not None and any(
            self.clock.time() - event.issued_at < FRESH_S for event in events
        ):
            self._doorbell.ring(self.topics.control)
