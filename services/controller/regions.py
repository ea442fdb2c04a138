"""The controller's fleet-wide part: hotspot throttles of client regions (the imperative
shell of ``policy.hotspots``).

Every controller instance tails ``llm.arrivals`` (every ingress's counts per region,
groupless from the end) into its ``HotspotDetector`` and reads the control topic's
state (the controller follows it) to know whether the fleet is hurt (a pool's breaker
acting or its degradation ladder engaged, whichever instance decided it). Each tick it
evaluates; only the instance that owns the fleet's partition (``owner``) publishes: a
``RegionThrottle`` with scope ``hotspot:<region>`` when a region is throttled,
re-published while it holds (level-triggered, like every controller decision), and one
with no rate when it is lifted. The other instances keep their detectors warm, so the
partition's next owner decides the same.

Operators' throttles (``seawall region throttle``, scope ``region:<region>``) are other
keys: admission applies the latest issued of those naming a region, so an operator's
later throttle or lift wins over the controller's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from schemas import BreakerLevel, BreakerState, DegradationLevel, RegionThrottle
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import close, start_tail
from seawall_client.serde import ARRIVALS, decode
from services.common.bus import make_consumer, make_producer, topics_of
from services.common.consuming import ConsumerLoop, Record
from services.common.control_signing import send_signed, signer_for
from services.common.control_state import ControlState
from services.common.deadletters import failure_of
from services.common.lifecycle import Component
from services.controller.decider.evidence import republished, wire_evidence
from services.controller.policy.alerts import Condition
from services.controller.policy.decision import Decision
from services.controller.policy.hotspots import HotspotDetector, Throttle
from services.controller.settings import ControllerSettings

log = logging.getLogger(__name__)

SCOPE_PREFIX = "hotspot:"


def fleet_hurt(state: ControlState) -> bool:
    """A pool's breaker acting, or its degradation ladder engaged."""
    for breaker in state.all(BreakerState):
        if breaker.scope.startswith("pool:") and (
            breaker.state != "closed" or breaker.level >= BreakerLevel.RATE_LIMIT
        ):
            return True
    return any(d.level >= 1 for d in state.all(DegradationLevel))


class RegionGuard(Component):
    name = "region-guard"

    def __init__(
        self,
        settings: ControllerSettings,
        owner: Callable[[], bool],
        control: ControlState,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``control``: the control topic's state, followed by the controller."""
        super().__init__()
        self.settings = settings
        self.detector = HotspotDetector(settings.hotspot_config())
        self.control = control
        self._owner = owner
        self._clock = clock
        self._topics = topics_of(settings)
        self._producer = make_producer(settings)
        self._signer = signer_for(settings, "controller")
        self._consumer = make_consumer(settings, group_id=None)
        self._tail: ConsumerLoop[None] = ConsumerLoop(
            self._consumer,
            self,
            None,
            name="arrivals",
            commit=False,
            concurrency=1,
            start_consumer=False,
        )
        self._in_force: dict[str, RegionThrottle] = {}
        self._seq = 0
        self._last_republish = 0.0

    # -- lifecycle ---------------------------------------------------------------
    async def on_start(self) -> None:
        await self._producer.start()
        await start_tail(self._consumer, self._topics.arrivals)
        await self._tail.start()
        self.spawn(self._run(), "evaluate")

    async def on_stop(self) -> None:
        try:
            await self._tail.stop()
            await close(self._consumer)
        finally:
            await close(self._producer)

    # -- the arrivals tail's handler (``services.common.consuming``) ----------------
    async def decide(self, record: Record) -> None:
        report = decode(ARRIVALS, record.value)
        self.detector.record(self._clock.time(), dict(report.counts))

    async def effect(self, record: Record, decision: None) -> None:
        return None

    async def fail(self, record: Record, error: BaseException) -> None:
        """What is not an arrivals report is skipped (ingress owns the topic; one
        missed report only makes a rate look lower for a window)."""
        log.warning(
            "skipped a record that is not an arrivals report",
            extra={"reason": failure_of(error)[0]},
        )

    # -- decisions ---------------------------------------------------------------
    def conditions(self) -> list[Condition]:
        """An alert per region throttled now."""
        return [
            Condition(
                "hotspot_throttle",
                event.scope,
                None,
                "warning",
                f"region {event.region} is throttled to {event.rate_per_s:g}/s: its "
                "arrivals surged while the fleet was hurt",
                event.evidence,
            )
            for event in self._in_force.values()
            if event.rate_per_s is not None
        ]

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.controller_tick_s)
            await self.evaluate()

    async def evaluate(self) -> None:
        now = self._clock.time()
        events = [
            self._issue(d, now) for d in self.detector.evaluate(now, fleet_hurt(self.control))
        ]
        if now - self._last_republish >= self.settings.controller_republish_s:
            self._last_republish = now
            events += [
                self._republish(e, now) for e in self._in_force.values() if e.rate_per_s is not None
            ]
        if events and self._owner():
            await self._send(events)

    def _issue(self, decision: Decision[Throttle], now: float) -> RegionThrottle:
        region = decision.scope.removeprefix("region:")
        previous = decision.previous_state.rate_per_s
        event = RegionThrottle(
            scope=f"{SCOPE_PREFIX}{region}",
            seq=self._next_seq(now),
            issued_at=now,
            valid_for_s=self.settings.controller_valid_for_s,
            evidence=wire_evidence(
                decision.evidence, "none" if previous is None else f"{previous:g}/s"
            ),
            region=region,
            rate_per_s=decision.new_state.rate_per_s,
        )
        self._in_force[event.scope] = event
        log.warning(
            "region throttled" if event.rate_per_s is not None else "region throttle lifted",
            extra={
                "region": region,
                "rate_per_s": event.rate_per_s,
                "reason": event.evidence.reason,
            },
        )
        return event

    def _republish(self, event: RegionThrottle, now: float) -> RegionThrottle:
        again = republished(event, now, self._next_seq(now), self.settings.controller_valid_for_s)
        self._in_force[event.scope] = again
        return again

    def _next_seq(self, now: float) -> int:
        self._seq = max(self._seq + 1, int(now * 1_000_000))
        return self._seq

    async def _send(self, events: list[RegionThrottle]) -> None:
        await send_signed(self._producer, self._topics.control, events, self._signer)
