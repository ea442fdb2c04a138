"""Following the controller: apply control events idempotently by sequence, and know
how old the state in force is.

Admission and workers both read the control topic from the beginning with no consumer
group (every instance needs every decision). Apache Kafka compacts the topic to the
latest event per key; the embedded broker does not, and duplicates come with
at-least-once delivery and controller re-publication, so ``ControlState`` keeps, per
``control_key``, the event with the highest ``seq`` (latest wins) and ignores the rest.
If the controller falls silent, the last known state stays in force and its age grows
(``seawall_control_state_age_seconds``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from aiokafka import TopicPartition
from prometheus_client import Counter, Gauge

from schemas import BreakerLevel, BreakerState, ControlEvent
from services.common.bus import make_consumer
from services.common.clock import SYSTEM_CLOCK, Clock
from services.common.lifecycle import Component, cancel_tasks
from services.common.serde import CONTROL, DecodeError, decode
from services.common.settings import CommonSettings

log = logging.getLogger(__name__)

E = TypeVar("E", bound=ControlEvent)

#: Worker-breaker causes that take the worker out of its pool until its half-open probes
#: pass (DESIGN: a worker that stops sending heartbeats, or whose errors trip the
#: breaker, is isolated).
ISOLATING_CAUSES: frozenset[str] = frozenset({"heartbeat", "error_rate", "half_open_probe"})


def isolates(breaker: BreakerState) -> bool:
    """Whether a worker's breaker state removes the worker from its pool: open with an
    isolating cause, or open at level 3 or 4 (reject new, restart). Admission then gives
    it no share of the pool's work, and the worker leaves its consumer group so that its
    partitions go to the others. A latency trip alone (level 2) only paces it."""
    return breaker.state == "open" and (
        breaker.level >= BreakerLevel.REJECT_NEW or not ISOLATING_CAUSES.isdisjoint(breaker.tripped)
    )


CONTROL_EVENTS = Counter(
    "seawall_control_events_total", "Control events read, by outcome", ["kind", "outcome"]
)
CONTROL_AGE = Gauge(
    "seawall_control_state_age_seconds", "Seconds since the last control event was read"
)


class ControlState:
    """The latest control event per key. Pure: no I/O, time from the injected clock."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._latest: dict[str, ControlEvent] = {}
        self._last_heard: float | None = None

    def apply(self, event: ControlEvent) -> bool:
        """Keep ``event`` if it is newer than what is held for its key; True if it was."""
        self._last_heard = self._clock.monotonic()
        current = self._latest.get(event.control_key)
        if current is not None and current.seq >= event.seq:
            return False
        self._latest[event.control_key] = event
        return True

    def get(self, kind: type[E], scope: str) -> E | None:
        event = self._latest.get(f"{kind.model_fields['kind'].default}/{scope}")
        return event if isinstance(event, kind) else None

    def all(self, kind: type[E]) -> list[E]:
        return [e for e in self._latest.values() if isinstance(e, kind)]

    def age_s(self) -> float | None:
        """Seconds since any control event was last read (``None``: never)."""
        if self._last_heard is None:
            return None
        return self._clock.monotonic() - self._last_heard


class ControlFollower(Component):
    """Tails the control topic into a ``ControlState``; calls ``on_change`` for each
    event that changed the state. Undecodable records are counted and skipped: the
    controller is the only producer, so they are logged, not dead-lettered twice."""

    name = "control-follower"

    def __init__(
        self,
        settings: CommonSettings,
        topic: str,
        state: ControlState,
        on_change: Callable[[ControlEvent], None] | None = None,
    ) -> None:
        super().__init__()
        self._settings = settings
        self._topic = topic
        self.state = state
        self._on_change = on_change
        self._consumer = make_consumer(settings, group_id=None)

    async def on_start(self) -> None:
        await self._consumer.start()
        partitions = self._consumer.partitions_for_topic(self._topic) or {0}
        tps = [TopicPartition(self._topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        self._loop = self.spawn(self._run(), "follow")

    async def _run(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    self._handle(record.value)
            age = self.state.age_s()
            if age is not None:
                CONTROL_AGE.set(age)

    def _handle(self, raw: bytes | None) -> None:
        try:
            event = decode(CONTROL, raw)
        except DecodeError as e:
            CONTROL_EVENTS.labels("unknown", "invalid").inc()
            log.warning("skipped an invalid control event", extra={"reason": e.reason})
            return
        changed = self.state.apply(event)
        CONTROL_EVENTS.labels(event.kind, "applied" if changed else "stale").inc()
        if changed and self._on_change is not None:
            self._on_change(event)

    async def on_stop(self) -> None:
        await cancel_tasks({self._loop})
        await self._consumer.stop()
