"""One dispatch round of admission (pure: no Kafka, no Redis; time is ``now``).

The waiting requests sit in queues keyed by (class, requested pool). A round groups them
by *destination* pool (the requested pool, or the small pool where the degradation
ladder diverts the class), then per pool: a breaker refusing new work gets every request
for the pool picked (the caller answers them ``breaker_open``); otherwise the pool's
``RoundBudget`` (the pacing rule, ``capacity.FleetCapacity``, at the breaker's
rate-limit factor, and at most the half-open probes left) is filled slot by slot: the
pool's ``PriorityScheduler`` chooses among the classes whose longest-waiting request
fits the budget now (slots, KV and prefill tokens, the VIP reserve for VIP alone), and
that request goes, placed on a worker where the workers report their partitions
(``RoundBudget.take``; the round's ``placements``). A class whose head does not fit
yields its turn to one whose head does (work-conserving) without letting a smaller
request of its own jump the queue.

The scavenger lane (over-quota work of the tiers that allow it, keyed
``(SCAVENGER, requested pool)``) is never diverted and comes last: once every class's
work for the pool is dispatched, its requests take what the budget still holds, oldest
first, leaving ``scavenger_headroom`` of every budget free for the work that may come
next (a dispatched request cannot be taken back). It is shed — taken out to be
answered ``quota_exceeded`` (``AdmissionPolicy.shed``) — as soon as the pool is tight: a class's
work still waits after the round, the breaker paces or refuses the pool, the ladder
degrades it; and a request that waited ``scavenger_wait_s`` is shed anyway.

The round takes the picked and shed requests out of their queues and advances the
schedulers' counters; releasing the picked (``AdmissionPolicy.release``) and answering
the shed is the caller's next step.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Generic, Literal, Protocol, TypeVar

from schemas import InferenceRequest, Priority
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.cost import Cost
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.policy.outcomes import Accepted
from services.admission.policy.round_budget import Placement, PoolView, RoundBudget
from services.admission.policy.scheduler import ClassLoad, PriorityScheduler
from services.admission.policy.ttft import PoolForecast
from services.common.control_state import ControlState


class Waiting(Protocol):
    @property
    def since(self) -> float:
        """When it started waiting (the caller's monotonic clock)."""

    @property
    def cost(self) -> Cost:
        """What it will occupy on a worker."""

    @property
    def key(self) -> str:
        """Its record key (session or request id): its partition where no placement."""

    @property
    def session(self) -> str | None:
        """Its session, which keeps it on its session's worker while that has room."""


W = TypeVar("W", bound=Waiting)

SCAVENGER: Final = "scavenger"
Lane = Priority | Literal["scavenger"]
"""Where a waiting request queues: its class, or the scavenger lane."""


class Queued:
    """What a waiting request shows a dispatch round, from its request and its
    acceptance (a mixin for the shells' own waiting records, which declare
    ``request: InferenceRequest`` and ``accepted: Accepted``)."""

    __slots__ = ()
    request: InferenceRequest
    accepted: Accepted

    @property
    def cost(self) -> Cost:
        return self.accepted.cost

    @property
    def key(self) -> str:
        return self.request.dispatch_key

    @property
    def session(self) -> str | None:
        return self.request.session_id

    @property
    def lane(self) -> Lane:
        return SCAVENGER if self.accepted.scavenger else self.accepted.cls


@dataclass
class Round(Generic[W]):
    picked: list[W] = field(default_factory=list)
    """To release, in order."""
    placements: list[Placement | None] = field(default_factory=list)
    """Where each of ``picked`` goes (``None``: by its key; or to be answered)."""
    shed: list[W] = field(default_factory=list)
    """Scavenger-lane requests to answer ``quota_exceeded``."""
    views: dict[str, PoolView] = field(default_factory=dict)
    """The capacity of each pool with work, as the round saw it (a pool without work
    gets no budget: measuring one walks its workers)."""


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
    queues: Mapping[tuple[Lane, str], deque[W]],
    pools: Iterable[str],
    policy: AdmissionPolicy,
    control: ControlState,
    capacity: FleetCapacity,
    schedulers: Mapping[str, PriorityScheduler],
    now: float,
) -> Round[W]:
    """The requests to release now and to shed, and each pool's capacity."""
    feeding: dict[str, dict[Priority, list[deque[W]]]] = defaultdict(dict)
    scavengers: dict[str, list[deque[W]]] = defaultdict(list)
    for (lane, pool), dq in queues.items():
        if not dq:
            continue
        if lane == SCAVENGER:
            scavengers[pool].append(dq)
        else:
            dest = policy.destination(pool, lane, control)
            feeding[dest].setdefault(lane, []).append(dq)
    out: Round[W] = Round()
    for pool in pools:
        classes = feeding.get(pool, {})
        spare = scavengers.get(pool, [])
        if not classes and not spare:
            continue  # nothing for it: a budget costs a pass over its workers
        gate = policy.gate(pool, control)
        view, budget = capacity.budget(pool, now, gate.factor, gate.probes_left)
        out.views[pool] = view
        if gate.refuse:
            for dqs in classes.values():
                refused = take_oldest(dqs, sum(len(dq) for dq in dqs))
                out.picked += refused
                out.placements += [None] * len(refused)
        else:
            _fill(classes, budget, schedulers[pool], now, out)
        tight = (
            gate.refuse
            or gate.factor < 1.0
            or gate.probes_left is not None
            or policy.destination(pool, Priority.BULK, control) != pool
            or any(dq for dqs in classes.values() for dq in dqs)
        )
        if tight:
            out.shed += take_oldest(spare, sum(len(dq) for dq in spare))
            continue
        waited, headroom = policy.config.scavenger_wait_s, policy.config.scavenger_headroom
        while (head := _oldest(spare)) is not None:
            if now - head[0].since >= waited:
                out.shed.append(head.popleft())
            elif budget.fits(head[0].cost, vip=False, headroom=headroom):
                w = head.popleft()
                out.placements.append(budget.take(w.cost, False, headroom, w.key, w.session))
                out.picked.append(w)
            else:
                break
    return out


def _fill(
    classes: Mapping[Priority, list[deque[W]]],
    budget: RoundBudget,
    scheduler: PriorityScheduler,
    now: float,
    out: Round[W],
) -> None:
    # Per class with work: its oldest queue and the load the scheduler sees. A pick
    # changes the chosen class's alone, so only that one is looked up again.
    backlog = {cls: sum(len(d) for d in dqs) for cls, dqs in classes.items()}
    heads: dict[Priority, deque[W]] = {}
    waiting: dict[Priority, ClassLoad] = {}
    for cls, dqs in classes.items():
        dq = _oldest(dqs)
        if dq is not None:
            heads[cls] = dq
            waiting[cls] = ClassLoad(backlog[cls], now - dq[0].since)
    while True:
        # Every class with work is asked about (a class left out would count as idle and
        # lose its floor); those whose oldest request fits the budget can be chosen.
        fits = {cls for cls in waiting if budget.fits(heads[cls][0].cost, cls is Priority.VIP)}
        chosen = scheduler.next(waiting, fits) if fits else None
        if chosen is None:  # nothing fits, or the class owed a slot waits for room
            return
        w = heads[chosen].popleft()
        vip = chosen is Priority.VIP
        out.placements.append(budget.take(w.cost, vip, key=w.key, session=w.session))
        out.picked.append(w)
        backlog[chosen] -= 1
        head = _oldest(classes[chosen])
        if head is None:
            del heads[chosen], waiting[chosen]
        else:
            heads[chosen] = head
            waiting[chosen] = ClassLoad(backlog[chosen], now - head[0].since)


def forecasts(
    queues: Mapping[tuple[Lane, str], deque[W]],
    pools: Iterable[str],
    capacity: FleetCapacity,
    now: float,
) -> dict[str, PoolForecast]:
    """What each pool's TTFT prediction reads (``ttft``): its learned prefill rate, the
    prompt tokens queued in its engines and those waiting here per class."""
    waiting: dict[str, Counter[Priority]] = defaultdict(Counter)
    for (lane, pool), dq in queues.items():
        if lane != SCAVENGER:
            waiting[pool][lane] += sum(w.cost.prompt_tokens for w in dq)
    out: dict[str, PoolForecast] = {}
    for pool in pools:
        rate, step = capacity.prefill_rate(pool, now)
        queued = capacity.view(pool, now).prefill_in_pool
        out[pool] = PoolForecast(rate, queued, dict(waiting[pool]), step)
    return out
