"""The priority scheduler: VIP floor, minimum shares, weights, aging — by counting."""

from __future__ import annotations

from collections import Counter
from itertools import accumulate

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import Priority
from services.admission.policy.scheduler import (
    ORDER,
    ClassLoad,
    ClassPolicy,
    PriorityScheduler,
    SchedulerConfig,
)

pytestmark = pytest.mark.unit

VIP, STANDARD, BULK = Priority.VIP, Priority.STANDARD, Priority.BULK
SATURATED = {c: ClassLoad(1_000) for c in ORDER}
SLACK = 2  # each floor counter stays below 2 (see the module docstring)


def run(sched: PriorityScheduler, loads: dict[Priority, ClassLoad], n: int) -> Counter[Priority]:
    counts: Counter[Priority] = Counter()
    for _ in range(n):
        chosen = sched.next(loads)
        assert chosen is not None
        counts[chosen] += 1
    return counts


def test_no_work_no_dispatch() -> None:
    sched = PriorityScheduler()
    assert sched.next({}) is None
    assert sched.next({VIP: ClassLoad(0)}) is None
    assert sched.plan({}, 10) == {VIP: 0, STANDARD: 0, BULK: 0}


def test_work_conserving() -> None:
    sched = PriorityScheduler()
    assert run(sched, {BULK: ClassLoad(5)}, 50) == Counter({BULK: 50})


def test_default_shares_when_all_are_saturated() -> None:
    counts = run(PriorityScheduler(), SATURATED, 10_000)
    assert counts[VIP] > counts[STANDARD] > counts[BULK]
    assert counts[VIP] >= 1_000
    assert counts[STANDARD] >= 500
    assert counts[BULK] >= 500
    # weights 6:3:1 over the whole capacity, each above its floor
    assert counts[VIP] == pytest.approx(6_000, abs=3)
    assert counts[BULK] == pytest.approx(1_000, abs=3)


def test_vip_floor_holds_against_heavy_weights() -> None:
    config = SchedulerConfig(
        {
            VIP: ClassPolicy(min_share=0.10, weight=0.01),
            STANDARD: ClassPolicy(min_share=0.0, weight=100.0),
            BULK: ClassPolicy(min_share=0.0, weight=100.0),
        }
    )
    counts = run(PriorityScheduler(config), SATURATED, 1_000)
    assert counts[VIP] > 1_000 * 0.10 - SLACK


def test_aging_boosts_a_long_waiting_class() -> None:
    fresh = run(PriorityScheduler(), SATURATED, 1_000)
    aged_loads = {**SATURATED, BULK: ClassLoad(1_000, oldest_wait_s=30.0)}
    aged = run(PriorityScheduler(), aged_loads, 1_000)
    assert aged[BULK] > 2 * fresh[BULK]
    sched = PriorityScheduler()
    assert sched.weight(BULK, ClassLoad(1, 1e9)) == 4.0  # capped at max_age_boost


def test_plan_respects_capacity_and_backlog() -> None:
    sched = PriorityScheduler()
    plan = sched.plan({VIP: ClassLoad(2), STANDARD: ClassLoad(100), BULK: ClassLoad(100)}, 30)
    assert sum(plan.values()) == 30
    assert plan[VIP] == 2
    assert plan[STANDARD] > plan[BULK] >= 2
    assert sched.plan({VIP: ClassLoad(3)}, 10) == {VIP: 3, STANDARD: 0, BULK: 0}


@pytest.mark.parametrize(
    "policies",
    [
        {VIP: ClassPolicy(0.6, 1), STANDARD: ClassPolicy(0.3, 1), BULK: ClassPolicy(0.2, 1)},
        {VIP: ClassPolicy(0.1, 0), STANDARD: ClassPolicy(0.1, 1), BULK: ClassPolicy(0.1, 1)},
        {VIP: ClassPolicy(-0.1, 1), STANDARD: ClassPolicy(0.1, 1), BULK: ClassPolicy(0.1, 1)},
        {VIP: ClassPolicy(0.1, 1), STANDARD: ClassPolicy(0.1, 1)},
    ],
)
def test_config_validation(policies: dict[Priority, ClassPolicy]) -> None:
    with pytest.raises(ValueError, match=r"policy|shares|weights"):
        SchedulerConfig(policies)


# --- windows -------------------------------------------------------------------------------

shares = st.tuples(*(st.floats(0, 0.5) for _ in ORDER)).filter(lambda s: sum(s) <= 1)
weights = st.tuples(*(st.floats(0.01, 100) for _ in ORDER))
# per step: which classes have work, and how old their oldest request is
steps = st.lists(
    st.tuples(st.tuples(*(st.booleans() for _ in ORDER)), st.floats(0, 60)),
    min_size=50,
    max_size=300,
)


@settings(max_examples=60, deadline=None)
@given(shares, weights, steps, st.sampled_from([10, 20, 50, 100]))
def test_every_class_with_work_gets_its_min_share_in_any_window(
    mins: tuple[float, float, float],
    ws: tuple[float, float, float],
    pattern: list[tuple[tuple[bool, bool, bool], float]],
    window: int,
) -> None:
    config = SchedulerConfig(
        {c: ClassPolicy(m, w) for c, m, w in zip(ORDER, mins, ws, strict=True)}
    )
    sched = PriorityScheduler(config)
    has_work: dict[Priority, list[bool]] = {c: [] for c in ORDER}
    chosen: list[Priority | None] = []
    for busy, age in pattern:
        if not any(busy):
            busy = (False, False, True)
        loads = {
            c: ClassLoad(1, age * i) for i, (c, b) in enumerate(zip(ORDER, busy, strict=True)) if b
        }
        pick = sched.next(loads)
        assert pick in loads  # only a class with work, and always one when any has work
        chosen.append(pick)
        for c, b in zip(ORDER, busy, strict=True):
            has_work[c].append(b)
    for c, m in zip(ORDER, mins, strict=True):
        got = list(accumulate((p == c for p in chosen), initial=0))
        busy_run = list(accumulate((b for b in has_work[c]), initial=0))
        for start in range(len(pattern) - window + 1):
            end = start + window
            if busy_run[end] - busy_run[start] == window:  # work throughout the window
                assert got[end] - got[start] > window * m - SLACK, (c, start)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [(True, True, True), (True, False, True), (True, True, False), (True, False, False)]
        ),
        min_size=100,
        max_size=300,
    )
)
def test_vip_floor_under_default_config_with_others_coming_and_going(
    pattern: list[tuple[bool, bool, bool]],
) -> None:
    """VIP always has work; with adversarially heavy others it still gets >= its 10%."""
    config = SchedulerConfig(
        {
            VIP: ClassPolicy(0.10, 0.01),
            STANDARD: ClassPolicy(0.05, 50.0),
            BULK: ClassPolicy(0.05, 50.0),
        }
    )
    sched = PriorityScheduler(config)
    chosen = [
        sched.next({c: ClassLoad(1) for c, b in zip(ORDER, busy, strict=True) if b})
        for busy in pattern
    ]
    got = list(accumulate((p == VIP for p in chosen), initial=0))
    for window in (30, 100):
        for start in range(len(chosen) - window + 1):
            assert got[start + window] - got[start] > window * 0.10 - SLACK


# --- a class whose oldest request does not fit yet -----------------------------------


def test_a_class_owed_a_slot_holds_it_until_its_head_fits() -> None:
    """Under sustained VIP work, bulk's one large request does not fit for a while: VIP
    goes on until bulk's floor owes it a slot, then nothing goes ahead of bulk (``None``,
    every time, nothing changed) until it fits, and then bulk is served first."""
    sched = PriorityScheduler()
    loads = {VIP: ClassLoad(1_000), BULK: ClassLoad(1)}
    served = []
    for _ in range(100):
        pick = sched.next(loads, fits={VIP})
        if pick is None:
            break
        served.append(pick)
    assert set(served) == {VIP}
    assert len(served) == 19  # bulk's 5 % comes to one slot at the 20th
    assert [sched.next(loads, fits={VIP}) for _ in range(50)] == [None] * 50
    assert sched.next(loads, fits={VIP, BULK}) is BULK
    assert sched.next(loads, fits={VIP, BULK}) is VIP


def test_a_head_that_does_not_fit_yields_to_the_others_while_no_floor_is_owed() -> None:
    sched = PriorityScheduler()
    loads = {STANDARD: ClassLoad(5), BULK: ClassLoad(5)}
    assert sched.next(loads, fits={BULK}) is BULK
    assert sched.next(loads, fits=set()) is None


@settings(max_examples=60, deadline=None)
@given(
    shares,
    weights,
    st.lists(st.tuples(st.tuples(*(st.booleans() for _ in ORDER))), min_size=50, max_size=300),
    st.sampled_from([10, 20, 50]),
)
def test_floors_count_the_slots_served_whatever_fits_meanwhile(
    mins: tuple[float, float, float],
    ws: tuple[float, float, float],
    fitting: list[tuple[tuple[bool, bool, bool]]],
    window: int,
) -> None:
    """Every class has work throughout; at each step only some heads fit. Counting the
    slots actually served (a held step serves none), each class still gets more than
    its share of any window, less the slack: not fitting for a while costs a class
    nothing of its floor."""
    config = SchedulerConfig(
        {c: ClassPolicy(m, w) for c, m, w in zip(ORDER, mins, ws, strict=True)}
    )
    sched = PriorityScheduler(config)
    loads = {c: ClassLoad(1) for c in ORDER}
    chosen: list[Priority] = []
    for (fit,) in fitting:
        fits = {c for c, f in zip(ORDER, fit, strict=True) if f}
        pick = sched.next(loads, fits)
        if pick is None:
            # Held for a class owed a slot (or nothing fits): once it fits it is served.
            pick = sched.next(loads, set(ORDER))
        assert pick is not None
        chosen.append(pick)
    for c, m in zip(ORDER, mins, strict=True):
        got = list(accumulate((p == c for p in chosen), initial=0))
        for start in range(len(chosen) - window + 1):
            assert got[start + window] - got[start] > window * m - SLACK, (c, start)
