"""Following the controller: apply control events idempotently by sequence, trust them
only while they are valid, and know how old the state in force is.

Admission and workers both read the control topic from the beginning with no consumer
group (every instance needs every decision). Apache Kafka compacts the topic to the
latest event per key; the embedded broker does not, and duplicates come with
at-least-once delivery and controller re-publication, so ``ControlState`` keeps, per
``control_key``, the event with the highest ``seq`` (latest wins) and ignores the rest.

A decision is in force until ``issued_at + valid_for_s`` (the controller re-publishes
the decisions in force every few seconds, each time extending ``valid_for_s``). Past
that the controller has fallen silent, and a decision it can no longer vouch for
("reject new work", "static replies") must not stay in force for ever: the services
``expire`` it — it is dropped, counted (``seawall_control_expired_total``) and logged,
and whoever applied it falls back to the default. The times are the controller's and
the consumer's wall clocks: keep them in sync (NTP), as ``valid_for_s`` (60 s by
default) is meant to be far above any skew. The CLI's views keep expired decisions
(``in_force_only=False``) and show them as such.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar, cast

from aiokafka import TopicPartition
from prometheus_client import Counter, Gauge

from schemas import BreakerLevel, BreakerState, ControlEvent
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import close
from seawall_client.serde import CONTROL, decode
from services.common.bus import make_consumer
from services.common.consuming import ConsumerLoop, Record
from services.common.deadletters import DeadLetters, failure_of
from services.common.lifecycle import Component
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
CONTROL_EXPIRED = Counter(
    "seawall_control_expired_total",
    "Control decisions dropped because valid_for_s passed without a re-publication",
    ["kind"],
)
CONTROL_AGE = Gauge(
    "seawall_control_state_age_seconds", "Seconds since the last control event was read"
)


def in_force(event: ControlEvent, now: float) -> bool:
    """Whether ``event`` may still be trusted at ``now`` (epoch seconds)."""
    return now < event.issued_at + event.valid_for_s


class ControlState:
    """The latest control event per key. Pure: no I/O, time from the injected clock.

    With ``in_force_only`` (services), ``get`` and ``all`` see only decisions still in
    force, and ``expire`` drops the others; without it (the CLI's views) they see the
    latest event per key whatever its age."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK, *, in_force_only: bool = True) -> None:
        self._clock = clock
        self._in_force_only = in_force_only
        self._latest: dict[str, ControlEvent] = {}
        self._kinds: defaultdict[str, dict[str, ControlEvent]] = defaultdict(dict)
        """``_latest`` by kind: ``all`` is asked per request, and a fleet holds a
        decision per worker."""
        self._floor: dict[str, int] = {}
        """Per key, the ``seq`` of the last expired event: nothing older comes back."""
        self._last_heard: float | None = None

    def apply(self, event: ControlEvent) -> bool:
        """Keep ``event`` if it is newer than what is held for its key; True if it was."""
        self._last_heard = self._clock.monotonic()
        key = event.control_key
        current = self._latest.get(key)
        if current is not None and current.seq >= event.seq:
            return False
        if event.seq <= self._floor.get(key, -1):
            return False
        self._latest[key] = event
        self._kinds[event.kind][key] = event
        return True

    def _visible(self, event: ControlEvent | None) -> bool:
        return event is not None and (
            not self._in_force_only or in_force(event, self._clock.time())
        )

    def get(self, kind: type[E], scope: str) -> E | None:
        event = self._latest.get(f"{kind.model_fields['kind'].default}/{scope}")
        return event if isinstance(event, kind) and self._visible(event) else None

    def all(self, kind: type[E]) -> list[E]:
        events = cast(dict[str, E], self._kinds.get(kind.model_fields["kind"].default, {}))
        if not self._in_force_only:
            return list(events.values())
        now = self._clock.time()
        return [e for e in events.values() if in_force(e, now)]

    def expire(self) -> list[ControlEvent]:
        """Drop the decisions whose validity has run out (counted and logged); return
        them, so that whoever applied one can fall back to its default."""
        now = self._clock.time()
        gone = [e for e in self._latest.values() if not in_force(e, now)]
        for event in gone:
            del self._latest[event.control_key]
            del self._kinds[event.kind][event.control_key]
            self._floor[event.control_key] = event.seq
            CONTROL_EXPIRED.labels(event.kind).inc()
            # The controller re-publishes what it decided: one of its decisions running
            # out means it stopped. An operator's (``seawall quota``, ``seawall region``)
            # runs out at the end of the time it was given.
            by_controller = event.issuer == "controller"
            log.log(
                logging.WARNING if by_controller else logging.INFO,
                "a control decision expired without a re-publication; back to the default"
                if by_controller
                else "an operator's decision ran out; back to the default",
                extra={
                    "key": event.control_key,
                    "seq": event.seq,
                    "issued_at": event.issued_at,
                    "valid_for_s": event.valid_for_s,
                },
            )
        return gone

    def age_s(self) -> float | None:
        """Seconds since any control event was last read (``None``: never)."""
        if self._last_heard is None:
            return None
        return self._clock.monotonic() - self._last_heard


class ControlFollower(Component):
    """Tails the control topic into a ``ControlState``; calls ``on_change`` for each
    event that changed the state, and ``on_expire`` for each decision that expired
    (checked after every fetch, at least every half second). A record that is not a
    control event is dead-lettered when ``dead_letters`` is given (one follower per
    fleet should: admission's), else counted and logged; either way the follower
    carries on (``services.common.consuming``)."""

    name = "control-follower"

    def __init__(
        self,
        settings: CommonSettings,
        topic: str,
        state: ControlState,
        on_change: Callable[[ControlEvent], None] | None = None,
        *,
        on_expire: Callable[[ControlEvent], None] | None = None,
        dead_letters: DeadLetters | None = None,
    ) -> None:
        super().__init__()
        self._settings = settings
        self._topic = topic
        self.state = state
        self._on_change = on_change
        self._on_expire = on_expire
        self._dead_letters = dead_letters
        self._consumer = make_consumer(settings, group_id=None)
        self._loop: ConsumerLoop[ControlEvent] = ConsumerLoop(
            self._consumer,
            self,
            dead_letters,
            name=self.name,
            commit=False,
            concurrency=1,
            fetch_timeout_ms=500,
            start_consumer=False,
            after_fetch=self._expire,
        )

    async def on_start(self) -> None:
        await self._consumer.start()
        partitions = self._consumer.partitions_for_topic(self._topic) or {0}
        tps = [TopicPartition(self._topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        await self._loop.start()
        self.spawn(self._watch(), "watch")

    async def _watch(self) -> None:
        await self._loop.failed.wait()
        raise RuntimeError("the control follower's loop failed") from self._loop.failure

    async def on_stop(self) -> None:
        await self._loop.stop()
        await close(self._consumer)

    def _expire(self) -> None:
        for event in self.state.expire():
            if self._on_expire is not None:
                self._on_expire(event)
        age = self.state.age_s()
        if age is not None:
            CONTROL_AGE.set(age)

    # -- the handler (services.common.consuming.Handler) ---------------------------
    async def decide(self, record: Record) -> ControlEvent:
        return decode(CONTROL, record.value)

    async def effect(self, record: Record, decision: ControlEvent) -> None:
        changed = self.state.apply(decision)
        CONTROL_EVENTS.labels(decision.kind, "applied" if changed else "stale").inc()
        if changed and self._on_change is not None:
            self._on_change(decision)

    async def fail(self, record: Record, error: BaseException) -> None:
        CONTROL_EVENTS.labels("unknown", "invalid").inc()
        if self._dead_letters is not None:
            await self._dead_letters.record(record, error)
            return
        reason, _ = failure_of(error)
        log.warning("skipped an invalid control event", extra={"reason": reason})
