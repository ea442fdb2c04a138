"""The pacing rule in the engine's units (capacity.py, dispatching.py): KV and prefill
tokens, the KV correction from usage and preemptions, and the VIP reserve."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import Priority
from seawall_client.clock import ManualClock
from services.admission.policy.bucket import DEFAULT_TIERS
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.config import PolicyConfig
from services.admission.policy.cost import Cost
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.policy.dispatching import pick
from services.admission.policy.round_budget import RoundBudget
from services.admission.policy.scheduler import ClassLoad, PriorityScheduler
from services.admission.policy.workers import CapacityConfig
from services.common.control_state import ControlState
from tests.admission_helpers import Item, engine_stats, heartbeat

pytestmark = pytest.mark.unit

VIP, STANDARD, BULK = Priority.VIP, Priority.STANDARD, Priority.BULK
NOW = 1_800_000_000.0


def fleet(reserve: float = 0.0, **changes: float) -> FleetCapacity:
    config = CapacityConfig(slack=0, kv_fill=1.0, vip_reserve=reserve, **changes)  # type: ignore[arg-type]
    return FleetCapacity(config)


def worker(
    cap: FleetCapacity,
    name: str = "w1",
    *,
    slots: int = 100,
    kv: int = 10_000,
    batched: int = 1_000,
    now: float = 0.0,
    usage: float = 0.0,
    preempted: int = 0,
    pending: int = 0,
) -> None:
    cap.observe(
        engine_stats(
            name,
            "main",
            slots,
            kv_capacity_tokens=kv,
            max_num_batched_tokens=batched,
            kv_cache_usage=usage,
            preempted_total=preempted,
            prefill_pending_tokens=pending,
        ),
        now=now,
    )


def admitted(budget: RoundBudget, costs: list[Cost], vip: bool = False) -> int:
    """How many of ``costs``, in order, the budget takes before one does not fit."""
    n = 0
    for cost in costs:
        if not budget.fits(cost, vip):
            break
        budget.take(cost)
        n += 1
    return n


def test_kv_reservations_stop_at_the_kv_capacity() -> None:
    cap = fleet(prefill_steps=100)
    worker(cap, kv=10_000)
    view, budget = cap.budget("main", now=0.0)
    assert (view.kv_budget, view.kv_in_pool) == (10_000, 0)
    assert admitted(budget, [Cost(1_000, 2_000)] * 10) == 3  # 9,000 of 10,000 tokens
    assert budget.fits(Cost(500, 500), vip=False)  # exactly the last 1,000
    assert not budget.fits(Cost(500, 501), vip=False)


def test_prefill_tokens_waiting_for_their_first_token_are_bounded() -> None:
    cap = fleet(prefill_steps=2)  # 2 steps of 1,000 batched tokens
    worker(cap, batched=1_000, kv=10**6)
    _, budget = cap.budget("main", now=0.0)
    assert admitted(budget, [Cost(800, 10)] * 5) == 2
    # A worker that reports a prefill queue already has less room.
    worker(cap, batched=1_000, kv=10**6, pending=1_500, now=1.0)
    _, budget = cap.budget("main", now=1.0)
    assert admitted(budget, [Cost(400, 10)] * 5) == 1


def test_one_request_always_fits_a_dimension_that_holds_nothing() -> None:
    """A prompt larger than the whole prefill budget must not wait forever."""
    cap = fleet(prefill_steps=1)
    worker(cap, batched=1_000, kv=10**6)
    _, budget = cap.budget("main", now=0.0)
    assert admitted(budget, [Cost(3_000, 10), Cost(1, 1)]) == 1


def test_dispatches_count_until_a_completion_frees_their_tokens() -> None:
    cap = fleet(prefill_steps=100)
    worker(cap, kv=10_000)
    cap.dispatched("main", "r1", now=0.5, cost=Cost(2_000, 3_000))
    view = cap.view("main", now=0.6)
    assert (view.kv_in_pool, view.prefill_in_pool) == (5_000, 2_000)
    # The worker's next report shows its prefill done (first token) and its KV in use.
    worker(cap, kv=10_000, usage=0.3, now=1.0)
    view = cap.view("main", now=1.0)
    assert (view.kv_in_pool, view.prefill_in_pool) == (5_000, 0)  # the reservation holds
    cap.completed("w1", "r1", now=1.5)
    assert cap.view("main", now=1.5).kv_in_pool == 3_000  # what the engine last reported


def test_the_vip_reserve_is_left_to_vip_in_every_dimension() -> None:
    cap = fleet(reserve=0.2, prefill_steps=100)
    worker(cap, slots=10, kv=10_000)
    _, budget = cap.budget("main", now=0.0)
    assert admitted(budget, [Cost(500, 500)] * 20) == 8  # slots: 8 of 10 (and 8,000 KV)
    assert admitted(budget, [Cost(500, 500)] * 20, vip=True) == 2
    # KV bound: big requests stop at 8,000 tokens for others, 10,000 for VIP.
    cap = fleet(reserve=0.2, prefill_steps=100)
    worker(cap, slots=100, kv=10_000)
    _, budget = cap.budget("main", now=0.0)
    assert admitted(budget, [Cost(1_000, 1_000)] * 10) == 4
    assert admitted(budget, [Cost(1_000, 1_000)] * 10, vip=True) == 1


def test_preemptions_shrink_the_kv_budget_and_a_cool_cache_grows_it_back() -> None:
    cap = fleet(kv_backoff=0.5, kv_step=0.1, kv_scale_max=1.2, kv_high=0.8)
    worker(cap, kv=10_000, usage=0.9)  # hot and no preemption yet: held at 1.0
    assert cap.view("main", now=0.0).kv_budget == 10_000
    worker(cap, kv=10_000, usage=0.95, preempted=3, now=1.0)
    assert cap.view("main", now=1.0).kv_budget == 5_000
    worker(cap, kv=10_000, usage=0.95, preempted=4, now=2.0)
    assert cap.view("main", now=2.0).kv_budget == 3_000  # the floor, kv_scale_min 0.3
    budgets = []
    for i in range(12):
        worker(cap, kv=10_000, usage=0.5, preempted=4, now=3.0 + i)
        budgets.append(cap.view("main", now=3.0 + i).kv_budget)
    assert budgets[0] == 4_000
    assert budgets == sorted(budgets)
    assert budgets[-1] == 12_000


def test_a_rate_limited_pool_scales_its_token_budgets_too() -> None:
    cap = fleet(prefill_steps=2)
    worker(cap, kv=10_000, batched=1_000)
    view = cap.view("main", now=0.0, factor=0.5)
    assert (view.kv_budget, view.prefill_budget) == (5_000, 1_000)


def test_a_worker_without_engine_stats_does_not_limit_tokens() -> None:
    cap = fleet()
    cap.report("w1", "main", batch_limit=4, in_flight=0, now=0.0)
    view, budget = cap.budget("main", now=0.0)
    assert not view.kv_limited
    assert not view.prefill_limited
    assert admitted(budget, [Cost(10**6, 10**6)] * 10) == 4  # slots alone


# -- a dispatch round ---------------------------------------------------------------


def run_round(
    cap: FleetCapacity,
    content: list[tuple[Priority, Cost, int]],
    scheduler: PriorityScheduler | None = None,
) -> tuple[list[Item], dict[tuple[Priority, str], deque[Item]]]:
    qs: dict[tuple[Priority, str], deque[Item]] = {}
    t = -100.0
    for cls, cost, n in content:
        dq = qs.setdefault((cls, "main"), deque())
        for _ in range(n):
            t += 1
            dq.append(Item(f"{cls.value}{len(dq)}", t, cost))
    policy = AdmissionPolicy(PolicyConfig(tiers=DEFAULT_TIERS, pools=("main",)))
    control = ControlState(ManualClock(NOW))
    schedulers = {"main": scheduler or PriorityScheduler()}
    picked = pick(qs, ("main",), policy, control, cap, schedulers, 0.0).picked
    return picked, qs


def test_a_long_prompt_burst_waits_in_admission_and_short_vip_work_passes_it() -> None:
    cap = fleet(reserve=0.1)  # prefill budget: 4 steps of 1,000 tokens
    worker(cap, batched=1_000, kv=100_000)
    long_bulk, short_vip = Cost(3_000, 200), Cost(100, 200)
    picked, qs = run_round(cap, [(BULK, long_bulk, 10), (VIP, short_vip, 5)])
    names = [i.name for i in picked]
    # One long prompt (3,000 of the 3,600 bulk may queue), then every VIP request,
    # though the bulk work has waited longer.
    assert sorted(names) == ["bulk0", "vip0", "vip1", "vip2", "vip3", "vip4"]
    assert len(qs[(BULK, "main")]) == 9


def test_a_class_whose_head_does_not_fit_yields_without_reordering_itself() -> None:
    cap = fleet()
    worker(cap, batched=1_000, kv=100_000)  # prefill budget 4,000
    picked, qs = run_round(cap, [(STANDARD, Cost(3_500, 10), 2), (BULK, Cost(100, 10), 3)])
    # standard0 takes 3,500 of the 4,000; standard1 does not fit, and bulk's small
    # requests take what is left.
    assert sorted(i.name for i in picked) == ["bulk0", "bulk1", "bulk2", "standard0"]
    assert [i.name for i in qs[(STANDARD, "main")]] == ["standard1"]


COSTS = st.builds(Cost, st.integers(1, 5_000), st.integers(1, 2_000))


@settings(max_examples=200, deadline=None)
@given(
    content=st.lists(
        st.tuples(st.sampled_from([VIP, STANDARD, BULK]), COSTS, st.integers(1, 6)),
        min_size=1,
        max_size=8,
    ),
    reserve=st.sampled_from([0.0, 0.1, 0.3]),
    pending=st.integers(0, 3_000),
    slots=st.integers(1, 40),
    earlier=st.integers(0, 60),
)
def test_a_round_keeps_every_budget_and_is_work_conserving(
    content: list[tuple[Priority, Cost, int]],
    reserve: float,
    pending: int,
    slots: int,
    earlier: int,
) -> None:
    cap = fleet(reserve=reserve, prefill_steps=2)
    worker(cap, slots=slots, batched=2_000, kv=20_000, pending=pending)
    view = cap.view("main", now=0.0)
    scheduler = PriorityScheduler()
    for _ in range(earlier):  # earlier rounds: floors part paid, part owed
        scheduler.next({c: ClassLoad(1) for c in (VIP, STANDARD, BULK)})
    picked, qs = run_round(cap, content, scheduler)
    assert len(picked) <= view.free
    everyone = [i.cost for i in picked]
    # Over budget only through the "one request fits an empty dimension" rule.
    kv = sum(c.kv_tokens for c in everyone)
    assert kv <= view.kv_budget or len(everyone) == 1
    prefill = pending + sum(c.prompt_tokens for c in everyone)
    assert prefill <= view.prefill_budget or (len(everyone) == 1 and pending == 0)
    # Work other than VIP's was admitted only within the budget less the reserve.
    kv_before, prefill_before = 0, pending
    for item in picked:
        kv_before += item.cost.kv_tokens
        prefill_before += item.cost.prompt_tokens
        if not item.name.startswith("vip") and kv_before > item.cost.kv_tokens:
            assert kv_before <= view.kv_budget * (1 - reserve)
        if not item.name.startswith("vip") and prefill_before > item.cost.prompt_tokens:
            assert prefill_before <= view.prefill_budget * (1 - reserve)
    # Work-conserving: no class's head would still fit what the round left — unless
    # the round stopped for a class its floor owes a slot, whose head does not fit.
    used = RoundBudget(view, reserve)
    for c in everyone:
        used.take(c)
    heads = {cls: dq[0] for (cls, _), dq in qs.items() if dq}
    fits = {cls for cls, head in heads.items() if used.fits(head.cost, cls is VIP)}
    if fits:
        loads = {cls: ClassLoad(len(qs[(cls, "main")]), -head.since) for cls, head in heads.items()}
        assert scheduler.next(loads, fits) is None


def report(cap: FleetCapacity, now: float, pending: int, done: int) -> None:
    """``w1``'s EngineStats: its prefill queue and the prompt tokens prefilled so far."""
    stats = engine_stats(
        "w1",
        "main",
        100,
        kv_capacity_tokens=10**6,
        max_num_batched_tokens=1_000,
        prefill_pending_tokens=pending,
    )
    cap.observe(stats.model_copy(update={"prefilled_tokens_total": done}), now=now)


def test_a_workers_prefill_rate_is_learned_from_busy_intervals_and_drains_its_queue() -> None:
    cap = fleet(prefill_steps=2)  # 2,000 tokens of prefill budget

    report(cap, 0.0, 1_800, 0)
    assert cap.view("main", now=0.5).prefill_in_pool == 1_800  # no rate known: no drain
    report(cap, 1.0, 1_600, 4_000)  # busy at both ends: 4,000 tokens/s
    assert cap.view("main", now=1.0).prefill_in_pool == 1_600
    assert cap.view("main", now=1.25).prefill_in_pool == 600  # drained at 4,000/s
    assert cap.view("main", now=2.0).prefill_in_pool == 0
    # An interval that ended idle measures the load, not the engine: not learned.
    report(cap, 2.0, 0, 5_000)
    report(cap, 3.0, 500, 5_100)
    assert cap.view("main", now=3.1).prefill_in_pool == 100  # still 4,000/s


def test_prompts_placed_since_the_report_drain_with_the_queue() -> None:
    cap = fleet(prefill_steps=2)
    hb = heartbeat("w1", batch_limit=100)
    cap.observe(hb.model_copy(update={"partitions": (0,)}), now=0.0)

    report(cap, 0.0, 1_000, 0)
    report(cap, 1.0, 1_000, 2_000)  # 2,000 tokens/s
    cap.dispatched("main", "r1", now=1.1, cost=Cost(1_500, 10), worker="w1")
    (view,) = cap.worker_views("main", now=1.5)
    assert view.prefill_in_pool == 1_000 + 1_500 - 1_000


def test_a_dispatch_found_already_answered_frees_its_slot() -> None:
    """A restarted admission re-dispatches what its predecessor had not committed; the
    worker answers those copies 'already answered' with a repeat event (no completion
    will come): forgetting them frees their slots at once, not after ledger_ttl_s."""
    cap = fleet()
    worker(cap, slots=4)
    for i in range(4):
        cap.dispatched("main", f"acme|r{i}", 0.0, Cost(10, 10), "w1")
    assert cap.free("main", 0.0) == 0
    cap.forget("acme|r0")
    cap.forget("acme|r1")
    assert cap.free("main", 0.0) == 2
    cap.forget("acme|nothing")  # not held: nothing changes
    assert cap.free("main", 0.0) == 2
