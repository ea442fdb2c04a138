"""One dispatch round of admission (pure: no Kafka, no Redis; time is ``now``).

The waiting requests sit in queues keyed by (class, requested pool). A round groups them
by *destination* pool (the requested pool, or the small pool where the degradation
ladder diverts the class), then per pool: a breaker refusing new work gets every request
for the pool picked (the caller answers them ``breaker_open``); otherwise the pool's free
capacity (the pacing rule, ``capacity.FleetCapacity``, at the breaker's rate-limit
factor, and at most the half-open probes left) is shared among the classes by the pool's
``PriorityScheduler``, and within a class the longest-waiting requests go first.

The round takes the picked requests out of their queues and advances the schedulers'
counters; releasing them (``AdmissionPolicy.release``) is the caller's next step.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from typing import Protocol, TypeVar

from schemas import Priority
from services.admission.capacity import FleetCapacity, PoolView
from services.admission.policy import AdmissionPolicy
from services.admission.scheduler import ClassLoad, PriorityScheduler
from services.common.control import ControlState


class Waiting(Protocol):
    since: float
    """When it started waiting (the caller's monotonic clock)."""


W = TypeVar("W", bound=Waiting)


def take_oldest(dqs: list[deque[W]], n: int) -> list[W]:
    """The ``n`` longest-waiting requests across ``dqs`` (fewer if they hold fewer)."""
    taken: list[W] = []
    for _ in range(n):
        dq = min((d for d in dqs if d), key=lambda d: d[0].since, default=None)
        if dq is None:
            break
        taken.append(dq.popleft())
    return taken


def pick(
    queues: Mapping[tuple[Priority, str], deque[W]],
    pools: Iterable[str],
    policy: AdmissionPolicy,
    control: ControlState,
    capacity: FleetCapacity,
    schedulers: Mapping[str, PriorityScheduler],
    now: float,
) -> tuple[list[W], dict[str, PoolView]]:
    """The requests to release now, and each pool's capacity as the round saw it."""
    feeding: dict[str, dict[Priority, list[deque[W]]]] = defaultdict(dict)
    for (cls, pool), dq in queues.items():
        if dq:
            dest = policy.destination(pool, cls, control)
            feeding[dest].setdefault(cls, []).append(dq)
    picked: list[W] = []
    views: dict[str, PoolView] = {}
    for pool in pools:
        gate = policy.gate(pool, control)
        view = views[pool] = capacity.view(pool, now, gate.factor)
        classes = feeding.get(pool)
        if not classes:
            continue
        if gate.refuse:
            for dqs in classes.values():
                picked += take_oldest(dqs, sum(len(dq) for dq in dqs))
            continue
        free = view.free if gate.probes_left is None else min(view.free, gate.probes_left)
        loads = {
            cls: ClassLoad(sum(len(dq) for dq in dqs), now - min(dq[0].since for dq in dqs))
            for cls, dqs in classes.items()
        }
        for cls, n in schedulers[pool].plan(loads, free).items():
            if n:
                picked += take_oldest(classes[cls], n)
    return picked, views
