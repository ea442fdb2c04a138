"""The worker's telemetry: its report each interval, its heartbeat, and the records it
queues on the telemetry and completion topics.

Each interval one ``WorkerReport`` carries the engine's state, the GPUs' readings
(``policy.reports`` builds both), a heartbeat and the summary of the requests finished
(``policy.summary``); a status change (draining, stopped) is told at once by a heartbeat on
its own. Nothing here is awaited for its ack: a lost report is superseded by the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

import psutil
from aiokafka import AIOKafkaProducer, TopicPartition

from schemas import EngineStats, WorkerHeartbeat, WorkerReport
from schemas.base import Message
from seawall_client.clock import Clock
from seawall_client.serde import encode
from seawall_client.topics import Topics
from services.common.failures import is_infrastructure
from services.common.hop_signing import hop_key_for, mac_headers
from services.workers import metrics as m
from services.workers.engine.base import Engine
from services.workers.gpu import GpuProbe
from services.workers.policy.reports import gpu_stats, limits_info
from services.workers.policy.summary import RequestSummarizer
from services.workers.runs import InHand
from services.workers.settings import WorkerSettings

Status = Literal["starting", "serving", "draining", "stopped"]
"""What the worker's heartbeat says it is doing."""


class Telemetry:
    """Publishes what the worker reports about itself."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        producer: AIOKafkaProducer,
        topics: Topics,
        engine: Engine,
        probe: GpuProbe,
        in_hand: InHand,
        summary: RequestSummarizer,
        started_at: float,
        incarnation: str,
        status: Callable[[], Status],
        partitions: Callable[[], frozenset[TopicPartition]],
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.worker_id = settings.instance_id
        self._producer = producer
        self.topics = topics
        self.engine = engine
        self.probe = probe
        self._in_hand = in_hand
        self._summary = summary
        self.started_at = started_at
        self.incarnation = incarnation
        self._status = status
        self._partitions = partitions
        self.clock = clock
        self._hop = hop_key_for(settings, "telemetry")

    async def publish(self, topic: str, message: Message) -> None:
        """Queue a telemetry or completion record (not awaited for its ack: a lost report
        is superseded by the next, and admission forgets a dispatch whose completion
        was lost after ``ledger_ttl_s``). Keyed by pool: the partition of the controller
        instance that decides for the pool (and still one partition per worker: its
        records stay in order). MACed for admission and the controller (``hop_signing``,
        the ``telemetry`` hop)."""
        try:
            value = encode(message)
            await self._producer.send(
                topic,
                value,
                key=self.settings.pool.encode(),
                headers=mac_headers(self._hop, topic, value),
            )
        except Exception as e:
            if not is_infrastructure(e):
                raise
            m.TELEMETRY_DROPPED.inc()

    async def loop(self) -> None:
        psutil.cpu_percent()  # the first call only sets the baseline
        while True:
            await asyncio.sleep(self.settings.telemetry_interval_s)
            await self.publish_stats()

    async def publish_stats(self) -> None:
        """The interval's ``WorkerReport``: engine, GPUs, heartbeat and the summary of
        the requests finished, in one record."""
        now = self.clock.time()
        snap = self.engine.snapshot()
        m.ENGINE_RUNNING.labels(self.settings.pool).set(snap.running)
        m.ENGINE_WAITING.labels(self.settings.pool).set(snap.waiting)
        m.KV_USAGE.labels(self.settings.pool).set(snap.kv_cache_usage)
        m.PREEMPTED.labels(self.settings.pool).set(snap.preempted_total)
        engine = EngineStats(
            worker_id=self.worker_id,
            pool=self.settings.pool,
            engine=self.engine.name,
            running=snap.running,
            waiting=snap.waiting,
            preempted_total=snap.preempted_total,
            kv_cache_usage=min(1.0, max(0.0, snap.kv_cache_usage)),
            in_flight=self._in_hand.in_flight,
            batch_limit=self._in_hand.batch_limit,
            limits=limits_info(snap.limits),
            at=now,
            prefill_pending_tokens=self._in_hand.prefill_pending_tokens,
            prefilled_tokens_total=self._in_hand.prefilled_tokens_total,
            completed_total=self._in_hand.completed_total,
            stalled_s=min(86_400.0, self._in_hand.stalled_s(self.clock.monotonic())),
        )
        gpus = []
        for g in self.probe.sample():
            m.export_gpu(self.settings.pool, g)
            gpus.append(gpu_stats(g, self.worker_id, self.settings.pool, now))
        await self.publish(
            self.topics.telemetry,
            WorkerReport(
                worker_id=self.worker_id,
                pool=self.settings.pool,
                at=now,
                heartbeat=self.heartbeat(now),
                engine=engine,
                gpus=tuple(gpus[:64]),
                requests=self._summary.take(now),
            ),
        )

    def heartbeat(self, now: float) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            pool=self.settings.pool,
            engine=self.engine.name,
            status=self._status(),
            in_flight=self._in_hand.in_flight,
            batch_limit=self._in_hand.batch_limit,
            host_cpu_pct=min(100.0, psutil.cpu_percent()),
            host_memory_pct=psutil.virtual_memory().percent,
            started_at=self.started_at,
            at=now,
            partitions=tuple(sorted(tp.partition for tp in self._partitions())),
            completed_total=self._in_hand.completed_total,
            incarnation=self.incarnation,
        )

    async def publish_heartbeat(self) -> None:
        """A heartbeat on its own: a status change (draining, stopped) told at once."""
        await self.publish(self.topics.telemetry, self.heartbeat(self.clock.time()))
