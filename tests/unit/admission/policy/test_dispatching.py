"""One dispatch round (dispatching.py): pacing, priority, diversion, breaker gates, age."""

from __future__ import annotations

import itertools
from collections import deque
from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import BreakerLevel, BreakerState, DegradationLevel, Evidence, Priority
from seawall_client.clock import ManualClock
from services.admission.policy.bucket import DEFAULT_TIERS
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.config import PolicyConfig
from services.admission.policy.cost import Cost
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.policy.dispatching import Round, _fill, pick, take_oldest
from services.admission.policy.round_budget import PoolView, RoundBudget
from services.admission.policy.scheduler import ClassLoad, PriorityScheduler
from services.admission.policy.workers import CapacityConfig
from services.common.control_state import ControlState
from tests.admission_helpers import Item

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0
POOLS = ("main", "small")
VIP, STANDARD, BULK = Priority.VIP, Priority.STANDARD, Priority.BULK
_seq = itertools.count(1)


Queues = dict[tuple[Priority, str], deque[Item]]


def queues(*content: tuple[Priority, str, int, float]) -> Queues:
    """(class, pool, how many, waiting since) → the queues, items named ``cls/pool/i``."""
    out: Queues = {}
    for cls, pool, n, since in content:
        dq = out.setdefault((cls, pool), deque())
        first = len(dq)
        dq.extend(Item(f"{cls.value}/{pool}/{first + i}", since + i) for i in range(n))
    return out


def fleet(**slots: int) -> FleetCapacity:
    cap = FleetCapacity()
    for pool, n in slots.items():
        cap.report(f"w-{pool}", pool, batch_limit=n, in_flight=0, now=0.0)
    return cap


def control(
    degradation: int | None = None,
    breaker: tuple[BreakerLevel, Literal["closed", "open", "half_open"], int] | None = None,
) -> ControlState:
    state = ControlState(ManualClock(NOW))
    common = {"scope": "pool:main", "issued_at": NOW, "evidence": Evidence(reason="t")}
    if degradation is not None:
        state.apply(DegradationLevel(**common, seq=next(_seq), level=degradation))
    if breaker is not None:
        level, circuit, probes = breaker
        state.apply(
            BreakerState(
                **common, seq=next(_seq), state=circuit, level=level, probe_requests=probes
            )
        )
    return state


def run(qs: Queues, cap: FleetCapacity, ctl: ControlState) -> list[str]:
    policy = AdmissionPolicy(PolicyConfig(tiers=DEFAULT_TIERS, pools=POOLS))
    schedulers = {pool: PriorityScheduler() for pool in POOLS}
    picked = pick(qs, POOLS, policy, ctl, cap, schedulers, now=0.0).picked
    return [item.name for item in picked]


def test_a_pool_gets_no_more_than_its_free_slots_and_vip_comes_first() -> None:
    qs = queues((BULK, "main", 5, -9.0), (VIP, "main", 5, -1.0))
    cap = fleet(main=2)  # the default slack adds 2: four free slots
    got = run(qs, cap, control())
    assert len(got) == 4
    assert got[0].startswith("vip/")
    assert sum(len(dq) for dq in qs.values()) == 6  # the picked left their queues


def test_each_pool_is_paced_by_its_own_capacity_and_only_pools_with_work_are_measured() -> None:
    qs = queues((STANDARD, "main", 3, 0.0), (STANDARD, "small", 3, 0.0))
    policy = AdmissionPolicy(PolicyConfig(tiers=DEFAULT_TIERS, pools=(*POOLS, "idle")))
    schedulers = {pool: PriorityScheduler() for pool in (*POOLS, "idle")}
    cap = fleet(small=8, idle=4)  # main has no live worker: its work waits
    chosen = pick(qs, (*POOLS, "idle"), policy, control(), cap, schedulers, now=0.0)
    picked, views = chosen.picked, chosen.views
    assert [i.name for i in picked] == ["standard/small/0", "standard/small/1", "standard/small/2"]
    assert {p: (v.slots, v.free) for p, v in views.items()} == {"main": (0, 0), "small": (8, 10)}


def test_level_1_diverts_non_vip_work_to_the_small_pool() -> None:
    qs = queues((VIP, "main", 2, 0.0), (BULK, "main", 2, 0.0))
    got = run(qs, fleet(small=8), control(degradation=1))  # only the small pool has slots
    assert sorted(got) == ["bulk/main/0", "bulk/main/1"]


def test_a_refusing_breaker_picks_every_request_of_its_pool_to_be_answered() -> None:
    qs = queues((VIP, "main", 3, 0.0), (BULK, "main", 4, 0.0))
    got = run(qs, fleet(), control(breaker=(BreakerLevel.REJECT_NEW, "open", 0)))
    assert len(got) == 7


def test_half_open_lets_only_its_probes_through() -> None:
    qs = queues((STANDARD, "main", 5, 0.0))
    got = run(qs, fleet(main=8), control(breaker=(BreakerLevel.REJECT_NEW, "half_open", 2)))
    assert len(got) == 2


def test_a_rate_limit_breaker_halves_the_slots() -> None:
    qs = queues((STANDARD, "main", 20, 0.0))
    cap = fleet(main=8)
    got = run(qs, cap, control(breaker=(BreakerLevel.RATE_LIMIT, "open", 0)))
    assert len(got) == 4 + cap.config.slack


@given(
    st.lists(st.lists(st.floats(-100, 0, allow_nan=False), max_size=6), min_size=1, max_size=4),
    st.integers(0, 30),
)
def test_take_oldest_takes_the_longest_waiting_across_queues(
    sinces: list[list[float]], n: int
) -> None:
    dqs = [
        deque(Item(f"{q}/{i}", s) for i, s in enumerate(sorted(ss))) for q, ss in enumerate(sinces)
    ]
    everything = sorted(s for ss in sinces for s in ss)
    taken = take_oldest(dqs, n)
    assert [item.since for item in taken] == everything[: min(n, len(everything))]
    assert sum(len(dq) for dq in dqs) == len(everything) - len(taken)


def test_a_pool_with_one_free_slot_a_round_still_gives_bulk_its_share() -> None:
    """A saturated pool frees one slot at a time: each round dispatches one request, and
    a round ending because nothing more fits is not a class running out of work (which
    would reset the scheduler's floors and credits every round and starve bulk)."""
    qs = queues((BULK, "main", 200, -9.0), (VIP, "main", 200, -1.0))
    policy = AdmissionPolicy(PolicyConfig(tiers=DEFAULT_TIERS, pools=POOLS))
    schedulers = {pool: PriorityScheduler() for pool in POOLS}
    order: list[str] = []
    for _ in range(100):
        # a worker running 3 of its 4 and no slack: exactly one request fits the round
        cap = FleetCapacity(CapacityConfig(slack=0))
        cap.report("w-main", "main", batch_limit=4, in_flight=3, now=0.0)
        picked = pick(qs, POOLS, policy, control(), cap, schedulers, now=0.0).picked
        assert len(picked) == 1
        order.append(picked[0].name.split("/")[0])
    # bulk's floor guarantees more than 100 x 5 % - 2; its weight (1 of 7 against VIP's
    # 6, boosted by its wait) gives it far more
    assert order.count("bulk") >= 10


def _fill_naive(
    classes: dict[Priority, list[deque[Item]]],
    budget: RoundBudget,
    scheduler: PriorityScheduler,
    now: float,
) -> list[str]:
    """A round filled by looking every class up again at every pick."""
    picked: list[str] = []
    while True:
        heads: dict[Priority, deque[Item]] = {}
        loads: dict[Priority, ClassLoad] = {}
        for cls, dqs in classes.items():
            dq = min((d for d in dqs if d), key=lambda d: d[0].since, default=None)
            if dq is not None and budget.fits(dq[0].cost, cls is Priority.VIP):
                heads[cls] = dq
                loads[cls] = ClassLoad(sum(len(d) for d in dqs), now - dq[0].since)
        chosen = scheduler.next(loads) if loads else None
        if chosen is None:
            return picked
        w = heads[chosen].popleft()
        budget.take(w.cost, chosen is Priority.VIP)
        picked.append(w.name)


@given(
    content=st.lists(
        st.tuples(
            st.sampled_from([VIP, STANDARD, BULK]),
            st.integers(0, 2),  # which of the class's queues (several feed one pool)
            st.integers(0, 120),  # waiting since, seconds before now: ages boost weights
            st.integers(0, 3000),  # prompt tokens
        ),
        max_size=60,
    ),
    slots=st.integers(0, 70),
    prefill=st.sampled_from([0, 5000, 40_000]),
)
def test_a_round_picks_as_if_every_class_were_looked_up_at_every_pick(
    content: list[tuple[Priority, int, int, int]], slots: int, prefill: int
) -> None:
    now = 1000.0

    def build() -> dict[Priority, list[deque[Item]]]:
        classes: dict[Priority, list[deque[Item]]] = {}
        for i, (cls, queue, age, prompt) in enumerate(content):
            dqs = classes.setdefault(cls, [deque(), deque(), deque()])
            dqs[queue].append(Item(f"r{i}", now - age, Cost(prompt, 16)))
        for dqs in classes.values():  # each queue in arrival order, as a backlog keeps it
            for dq in dqs:
                ordered = sorted(dq, key=lambda w: w.since)
                dq.clear()
                dq.extend(ordered)
        return classes

    def budget() -> RoundBudget:
        view = PoolView(1, slots, 0, slots, prefill_budget=prefill)
        return RoundBudget(view, vip_reserve=0.1)

    out: Round[Item] = Round()
    _fill(build(), budget(), PriorityScheduler(), now, out)
    assert [w.name for w in out.picked] == _fill_naive(build(), budget(), PriorityScheduler(), now)
