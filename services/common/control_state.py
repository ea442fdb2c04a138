"""The state of the controller's decisions as a service sees it: the latest control
event per key, applied idempotently by sequence and trusted only while it is valid.

Pure (no I/O, time from the injected clock), so the services' policies can read it;
``services.common.control.ControlFollower`` feeds it from the control topic.

Apache Kafka compacts the control topic to the latest event per key; the embedded broker
does not, and duplicates come with at-least-once delivery and controller re-publication,
so ``ControlState`` keeps, per ``control_key``, the event with the highest ``seq`` (latest
wins) and ignores the rest.

A decision is in force until ``issued_at + valid_for_s`` (the controller re-publishes
the decisions in force every few seconds, each time extending ``valid_for_s``). Past
that the controller has fallen silent, and a decision it can no longer vouch for
("reject new work", "static replies") must not stay in force for ever: ``expire`` drops
it, and whoever applied it falls back to the default. The times are the controller's and
the consumer's wall clocks: keep them in sync (NTP), as ``valid_for_s`` (60 s by
default) is meant to be far above any skew. The CLI's views keep expired decisions
(``in_force_only=False``) and show them as such.

An event from the future is refused (``refused`` counts it): issued more than
``MAX_SKEW_S`` after the reader's now, or with a ``seq`` beyond the hybrid clock's
(``seq`` is the issuer's microseconds, or one more than its last): a forged event dated
ahead, or with a huge ``seq``, would otherwise hold its key against every genuine
decision to come (one suspended a tenant that ``seawall quota clear`` could not lift).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import TypeVar, cast

from pydantic import BaseModel

from schemas import BreakerLevel, BreakerState, ControlEvent
from seawall_client.clock import SYSTEM_CLOCK, Clock

E = TypeVar("E", bound=ControlEvent)

_KINDS: dict[type[BaseModel], str] = {}
"""Each event class's ``kind``: read from the class's fields once, as the services ask
per request (pydantic's ``model_fields`` is slow to reach from the class)."""


def _kind(cls: type[BaseModel]) -> str:
    name = _KINDS.get(cls)
    if name is None:
        name = _KINDS[cls] = cls.model_fields["kind"].default
    return name


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


def in_force(event: ControlEvent, now: float) -> bool:
    """Whether ``event`` may still be trusted at ``now`` (epoch seconds)."""
    return now < event.issued_at + event.valid_for_s


MAX_SKEW_S = 30.0
"""How far ahead of the reader's clock an event may be dated (or numbered, in
microseconds) and still be kept."""

DEADLINES_PER_KEY = 4
"""How many heap entries per decision ``ControlState`` lets pile up (each
re-publication adds one) before it rebuilds the heap from the decisions it keeps."""


def _deadline(event: ControlEvent) -> tuple[float, int, str]:
    """When ``event`` stops being in force (``in_force``'s bound), its seq and key."""
    return (event.issued_at + event.valid_for_s, event.seq, event.control_key)


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
        self._deadlines: list[tuple[float, int, str]] = []
        """A heap of (end of validity, ``seq``, key) per event kept, the earliest first:
        ``expire`` runs after every fetch of the control topic, and scanning a fleet's
        decisions (one per worker and kind) each time was 7 % of the controller's
        profile samples at 5,000 workers. An entry whose event was replaced since is
        skipped."""
        self._last_heard: float | None = None
        self.refused = 0
        """Events refused for coming from the future (module notes)."""

    def apply(self, event: ControlEvent) -> bool:
        """Keep ``event`` if it is newer than what is held for its key, and not from the
        future; True if it was."""
        self._last_heard = self._clock.monotonic()
        horizon = self._clock.time() + MAX_SKEW_S
        if event.issued_at > horizon or event.seq > horizon * 1_000_000:
            self.refused += 1
            return False
        key = event.control_key
        current = self._latest.get(key)
        if current is not None and current.seq >= event.seq:
            return False
        if event.seq <= self._floor.get(key, -1):
            return False
        self._latest[key] = event
        self._kinds[event.kind][key] = event
        if len(self._deadlines) < DEADLINES_PER_KEY * len(self._latest):
            heapq.heappush(self._deadlines, _deadline(event))
        else:
            # Mostly entries of replaced events (each re-publication adds one): keep
            # the live ones only, so the heap stays proportional to the keys.
            self._deadlines = [_deadline(e) for e in self._latest.values()]
            heapq.heapify(self._deadlines)
        return True

    def _visible(self, event: ControlEvent | None) -> bool:
        return event is not None and (
            not self._in_force_only or in_force(event, self._clock.time())
        )

    def get(self, kind: type[E], scope: str) -> E | None:
        event = self._latest.get(f"{_kind(kind)}/{scope}")
        return event if isinstance(event, kind) and self._visible(event) else None

    def all(self, kind: type[E]) -> list[E]:
        events = cast(dict[str, E], self._kinds.get(_kind(kind), {}))
        if not events:
            return []
        if not self._in_force_only:
            return list(events.values())
        now = self._clock.time()
        return [e for e in events.values() if in_force(e, now)]

    def expire(self) -> list[ControlEvent]:
        """Drop the decisions whose validity has run out and return them, so that whoever
        applied one can fall back to its default (the follower counts and logs them)."""
        now = self._clock.time()
        gone: list[ControlEvent] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, seq, key = heapq.heappop(deadlines)
            event = self._latest.get(key)
            if event is None or event.seq != seq:
                continue  # replaced since (or already gone)
            gone.append(event)
            del self._latest[key]
            del self._kinds[event.kind][key]
            self._floor[key] = seq
        return gone

    def age_s(self) -> float | None:
        """Seconds since any control event was last read (``None``: never)."""
        if self._last_heard is None:
            return None
        return self._clock.monotonic() - self._last_heard
