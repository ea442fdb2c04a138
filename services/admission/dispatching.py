"""One dispatch round of admission (pure: no Kafka, no Redis; time is ``now``).

The waiting requests sit in queues keyed by (class, requested pool). A round groups them
by *destination* pool (the requested pool, or the small pool where the degradation
ladder diverts the class), then per pool: a breaker refusing new work gets every request
for the pool picked (the caller answers them ``breaker_open``); otherwise the pool's
``RoundBudget`` (the pacing rule, ``capacity.FleetCapacity``, at the breaker's
rate-limit factor, and at most the half-open probes left) is filled slot by slot: the
pool's ``PriorityScheduler`` chooses among the classes whose longest-waiting request
fits the budget now (slots, KV and prefill tokens, the VIP reserve for VIP alone), and
that request goes. A class whose head does not fit yields its turn to one whose head
does (work-conserving) without letting a smaller request of its own jump the queue.

The round takes the picked requests out of their queues and advances the schedulers'
counters; releasing them (``AdmissionPolicy.release``) is the caller's next step.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from typing import Protocol, TypeVar

from schemas import Priority
from services.admission.capacity import Cost, FleetCapacity, PoolView, RoundBudget
from services.admission.policy import AdmissionPolicy
from services.admission.scheduler import ClassLoad, PriorityScheduler
from services.common.control import ControlState


class Waiting(Protocol):
    @property
    def since(self) -> float:
        """When it started waiting (the caller's monotonic clock)."""

    @property
    def cost(self) -> Cost:
        """What it will occupy on a worker."""


W = TypeVar("W", bound=Waiting)


def _oldest(dqs: list[deque[W]]) -> deque[W] | None:
    return min((d for d in dqs if d), key=lambda d: d[0].since, default=None)


def take_oldest(dqs: list[deque[W]], n: int) -> list[W]:
    """The ``n`` longest-waiting requests across ``dqs`` (fewer if they hold fewer)."""
    taken: list[W] = []
    for _ in range(n):
        dq = _oldest(dqs)
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
        view, budget = capacity.budget(pool, now, gate.factor, gate.probes_left)
        views[pool] = view
        classes = feeding.get(pool)
        if not classes:
            continue
        if gate.refuse:
            for dqs in classes.values():
                picked += take_oldest(dqs, sum(len(dq) for dq in dqs))
            continue
        picked += _fill(classes, budget, schedulers[pool], now)
    return picked, views


def _fill(
    classes: Mapping[Priority, list[deque[W]]],
    budget: RoundBudget,
    scheduler: PriorityScheduler,
    now: float,
) -> list[W]:
    picked: list[W] = []
    while True:
        heads: dict[Priority, deque[W]] = {}
        loads: dict[Priority, ClassLoad] = {}
        for cls, dqs in classes.items():
            dq = _oldest(dqs)
            if dq is not None and budget.fits(dq[0].cost, cls is Priority.VIP):
                heads[cls] = dq
                backlog = sum(len(d) for d in dqs)
                loads[cls] = ClassLoad(backlog, now - dq[0].since)
        chosen = scheduler.next(loads)
        if chosen is None:
            return picked
        w = heads[chosen].popleft()
        budget.take(w.cost)
        picked.append(w)
