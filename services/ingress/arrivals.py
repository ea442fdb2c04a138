"""Requests per client region, reported to the controller for hotspot detection.

The pipeline counts every authenticated request by the region of its client
(``ArrivalCounter``, before any refusal: a surge is what arrives, not what is let
through); ``ArrivalReporter`` publishes the counts once a second as a
``RegionArrivals`` on ``llm.arrivals`` and starts a new interval. These are statistics:
a report the broker does not take is dropped (logged), never retried and never waited
for, and a client of no known region is not counted.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaProducer

from schemas import RegionArrivals
from schemas.arrivals import MAX_REGIONS
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.serde import encode
from services.common.failures import is_infrastructure
from services.common.lifecycle import Component

log = logging.getLogger(__name__)


class ArrivalCounter:
    """Requests per region since the last ``take`` (at most ``MAX_REGIONS`` regions an
    interval: the rest are not counted)."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._counts: dict[str, int] = {}
        self._since = clock.time()

    def count(self, region: str) -> None:
        if not region:
            return
        if region in self._counts:
            self._counts[region] += 1
        elif len(self._counts) < MAX_REGIONS:
            self._counts[region] = 1

    def take(self, instance: str) -> RegionArrivals | None:
        """The interval's report (``None`` if nothing arrived); a new interval starts."""
        now = self._clock.time()
        counts, self._counts = self._counts, {}
        since, self._since = self._since, now
        if not counts:
            return None
        window_s = min(86_400.0, max(0.0, now - since))
        return RegionArrivals(instance=instance, at=now, window_s=window_s, counts=counts)


class ArrivalReporter(Component):
    name = "arrivals"

    def __init__(
        self,
        counter: ArrivalCounter,
        producer: AIOKafkaProducer,
        topic: str,
        instance: str,
        interval_s: float = 1.0,
    ) -> None:
        super().__init__()
        self._counter = counter
        self._producer = producer
        self._topic = topic
        self._instance = instance
        self._interval_s = interval_s

    async def on_start(self) -> None:
        self.spawn(self._run(), "report")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            report = self._counter.take(self._instance)
            if report is None:
                continue
            try:
                await self._producer.send(self._topic, encode(report), key=self._instance.encode())
            except Exception as e:
                if not is_infrastructure(e):
                    raise
                log.warning("an arrivals report was dropped", extra={"error": str(e)})
