"""Admission's backlog: the accepted requests waiting for a dispatch slot.

The intake loop appends what it accepts; the dispatch loop takes what a round picks,
sheds or finds expired, and puts back what the broker did not take. Requests wait per
(lane, pool) — a lane is a class, or the scavenger lane — and each class counts what its
topics hold back here (``buffered``): a class holding ``max_buffered_per_class``
requests has its partitions paused. In memory only (no I/O): what waits here when
partitions are revoked or the service stops is not committed, and its next owner
decides it again.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aiokafka import TopicPartition

from schemas import InferenceRequest, Priority
from seawall_client.tracecontext import TraceContext
from services.admission.policy.dispatching import SCAVENGER, Lane, Queued
from services.admission.policy.outcomes import Accepted


@dataclass(slots=True)
class Waiting(Queued):
    """An accepted request waiting for a dispatch slot."""

    tp: TopicPartition
    offset: int
    request: InferenceRequest
    encoded: bytes
    """The request as its record carried it (it decoded to ``request``): its dispatch
    record reuses these bytes (``serde.encode_with``) instead of encoding it again."""
    source: Priority
    """The class of the topic it was read from (what pauses that topic)."""
    accepted: Accepted
    since: float
    trace: TraceContext | None = None
    """The span its record named as its cause (``traceparent``), under which admission
    records its stages, if traced."""
    accepted_ns: int = 0
    """When it was accepted (Unix nanoseconds; set where it is traced)."""


class Backlog:
    """The waiting requests per (lane, pool), and how many each class holds back."""

    def __init__(self) -> None:
        self.queues: defaultdict[tuple[Lane, str], deque[Waiting]] = defaultdict(deque)
        self.buffered: Counter[Priority] = Counter()

    def add(self, accepted: Iterable[Waiting]) -> None:
        for w in accepted:
            self.queues[(w.lane, w.accepted.pool)].append(w)
            self.buffered[w.source] += 1

    def count(self, cls: Priority) -> int:
        """Accepted requests waiting in class ``cls``."""
        return sum(len(dq) for (c, _), dq in self.queues.items() if c is cls)

    @property
    def empty(self) -> bool:
        """Nothing waits, in any lane."""
        return not any(self.queues.values())

    def scavengers(self) -> int:
        """Requests waiting in the scavenger lane."""
        return sum(len(dq) for (lane, _), dq in self.queues.items() if lane == SCAVENGER)

    def take_expired(self, now: float) -> list[Waiting]:
        return self.remove(lambda w: w.request.expired(now))

    def remove(self, which: Callable[[Waiting], bool]) -> list[Waiting]:
        """Take the waiting requests ``which`` selects out of every backlog."""
        removed: list[Waiting] = []
        for key, dq in list(self.queues.items()):
            keep: deque[Waiting] = deque()
            for w in dq:
                (removed if which(w) else keep).append(w)
            if len(keep) != len(dq):
                self.queues[key] = keep
        self.unbuffer(removed)
        return removed

    def drain(self) -> list[Waiting]:
        """Every waiting request, taken out (the service stops)."""
        waiting = [w for dq in self.queues.values() for w in dq]
        self.queues.clear()
        return waiting

    def pools(self, routed: tuple[str, ...]) -> tuple[str, ...]:
        """The pools dispatched to: configured, split to by a canary release (``routed``:
        ``AdmissionPolicy.pools``), or still holding queued work (a split that ended
        leaves its canary's queue to drain)."""
        queued = {pool for (_, pool), dq in self.queues.items() if dq and pool not in routed}
        return (*routed, *sorted(queued))

    def unbuffer(self, taken: Iterable[Waiting]) -> None:
        for w in taken:
            self.buffered[w.source] -= 1

    def requeue(self, waiting: list[Waiting]) -> None:
        """Put requests the broker did not take back at the head of their backlogs."""
        for w in reversed(waiting):
            self.queues[(w.lane, w.accepted.pool)].appendleft(w)
            self.buffered[w.source] += 1
