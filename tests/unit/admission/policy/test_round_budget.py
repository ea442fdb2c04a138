"""Placing requests on workers (round_budget.py): where workers report the partitions they
own, admission chooses each request's worker — least loaded, session affinity only
while the session's worker has room — instead of letting the key's hash choose."""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.admission.policy import round_budget
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.cost import Cost
from services.admission.policy.round_budget import PoolView, RoundBudget, WorkerView, _Room
from services.admission.policy.workers import CapacityConfig
from tests.admission_helpers import engine_stats, heartbeat

pytestmark = pytest.mark.unit

SMALL = Cost(100, 100)
RESERVE = 0.25


def fleet(*workers: tuple[str, int, tuple[int, ...]], in_flight: int = 0) -> FleetCapacity:
    """(worker id, batch limit, partitions owned) on the main pool."""
    cap = FleetCapacity(CapacityConfig(slack=0, kv_fill=1.0))
    for wid, slots, partitions in workers:
        hb = heartbeat(wid, batch_limit=slots, in_flight=in_flight)
        cap.observe(hb.model_copy(update={"partitions": partitions}), now=0.0)
    return cap


def place(
    cap: FleetCapacity, n: int, session: str | None = None, cost: Cost = SMALL
) -> list[str | None]:
    """Place ``n`` requests in one round (those that fit); the workers chosen."""
    _, budget = cap.budget("main", now=0.0)
    chosen: list[str | None] = []
    for i in range(n):
        if not budget.fits(cost, vip=False):
            break
        p = budget.take(cost, key=session or f"r{i}", session=session)
        chosen.append(None if p is None else p.worker_id)
    return chosen


def test_requests_go_to_the_least_loaded_worker() -> None:
    cap = fleet(("w1", 10, (0, 1)), ("w2", 10, (2, 3)))
    cap.observe(
        heartbeat("w1", batch_limit=10, in_flight=6).model_copy(update={"partitions": (0, 1)}),
        now=0.0,
    )
    got = place(cap, 12)
    # w2 alone until both hold 6; then they alternate.
    assert got[:6] == ["w2"] * 6
    assert Counter(got[6:]) == {"w1": 3, "w2": 3}


def test_a_session_stays_on_its_worker_while_it_has_room() -> None:
    cap = fleet(("w1", 4, (0,)), ("w2", 4, (1,)))
    got = place(cap, 8, session="chat-42")
    home = got[0]
    assert got[:4] == [home] * 4  # affinity while its worker has room
    assert got[4:] == [w for w in ("w1", "w2") if w != home] * 4  # then elsewhere


def test_the_record_goes_to_a_partition_its_worker_owns() -> None:
    cap = fleet(("w1", 50, (0, 1, 2)), ("w2", 50, (3, 4, 5)))
    _, budget = cap.budget("main", now=0.0)
    for i in range(40):
        p = budget.take(SMALL, key=f"r{i}")
        assert p is not None
        assert p.pool == "main"
        assert p.partition in {"w1": (0, 1, 2), "w2": (3, 4, 5)}[p.worker_id]


def test_without_partitions_the_key_places_the_record() -> None:
    cap = FleetCapacity(CapacityConfig(slack=0))
    cap.report("w1", "main", batch_limit=4, in_flight=0, now=0.0)
    assert place(cap, 4) == [None] * 4


def test_partitions_nobody_live_owns_get_nothing() -> None:
    """A worker that left (its partitions not reassigned yet) is not placed on."""
    cap = fleet(("w1", 10, (0, 1)), ("w2", 10, (2, 3)))
    cap.observe(
        heartbeat("w2", batch_limit=10, status="stopped").model_copy(update={"partitions": (2, 3)}),
        now=0.0,
    )
    assert set(place(cap, 10)) == {"w1"}


def test_a_worker_full_of_prefill_gets_no_long_prompt_while_another_is_free() -> None:
    cap = fleet(("w1", 64, (0,)), ("w2", 64, (1,)))
    for wid, pending in (("w1", 3_500), ("w2", 0)):
        cap.observe(
            engine_stats(
                wid, "main", 64, max_num_batched_tokens=1_000, prefill_pending_tokens=pending
            ),
            now=0.0,
        )
    # prefill budget 4 steps of 1,000 per worker: w1 has 500 left, w2 4,000
    assert place(cap, 2, cost=Cost(2_000, 10)) == ["w2", "w2"]


def test_the_ledger_counts_each_workers_placements_until_its_report() -> None:
    cap = fleet(("w1", 10, (0,)), ("w2", 10, (1,)))
    cap.dispatched("main", "a", now=0.5, cost=SMALL, worker="w1")
    cap.dispatched("main", "b", now=0.5, cost=SMALL, worker="w1")
    views = {v.worker_id: v for v in cap.worker_views("main", now=0.6)}
    assert (views["w1"].in_pool, views["w2"].in_pool) == (2, 0)
    cap.completed("w1", "a", now=0.7)
    views = {v.worker_id: v for v in cap.worker_views("main", now=0.7)}
    assert views["w1"].in_pool == 1


@settings(max_examples=150, deadline=None)
@given(
    workers=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), min_size=1, max_size=5),
    costs=st.lists(st.builds(Cost, st.integers(1, 3_000), st.integers(1, 500)), max_size=60),
)
def test_placements_keep_every_workers_budget(
    workers: list[tuple[int, int]], costs: list[Cost]
) -> None:
    cap = FleetCapacity(CapacityConfig(slack=0, kv_fill=1.0, prefill_steps=2))
    owned: dict[str, tuple[int, ...]] = {}
    for i, (slots, busy) in enumerate(workers):
        wid = f"w{i}"
        owned[wid] = (2 * i, 2 * i + 1)
        hb = heartbeat(wid, batch_limit=slots, in_flight=min(busy, slots))
        cap.observe(hb.model_copy(update={"partitions": owned[wid]}), now=0.0)
        cap.observe(
            engine_stats(
                wid,
                "main",
                slots,
                min(busy, slots),
                kv_capacity_tokens=8_000,
                max_num_batched_tokens=1_000,
            ),
            now=0.0,
        )
    views = {v.worker_id: v for v in cap.worker_views("main", now=0.0)}
    _, budget = cap.budget("main", now=0.0)
    placed: dict[str, list[Cost]] = {wid: [] for wid in owned}
    for i, cost in enumerate(costs):
        if budget.fits(cost, vip=False):
            p = budget.take(cost, key=f"r{i}")
            assert p is not None
            assert p.partition in owned[p.worker_id]
            placed[p.worker_id].append(cost)
    for wid, mine in placed.items():
        v = views[wid]
        assert v.in_pool + len(mine) <= v.slots
        kv = v.kv_in_pool + sum(c.kv_tokens for c in mine)
        assert kv <= v.kv_budget or (v.kv_in_pool == 0 and len(mine) == 1)


def test_short_work_goes_where_no_prefill_queues_long_prompts_where_there_is_room() -> None:
    """Every token of a short request waits behind its worker's prefill steps."""
    cap = fleet(("w1", 64, (0,)), ("w2", 64, (1,)))
    for wid, busy, pending in (("w1", 40, 0), ("w2", 2, 4_500)):
        stats = engine_stats(
            wid, "main", 64, busy, max_num_batched_tokens=2_048, prefill_pending_tokens=pending
        )
        cap.observe(stats, now=0.0)
    # w1: 40 of 64 slots, no prefill; w2: 2 slots, 2 steps of prefill (4,500 of 8,192)
    assert place(cap, 3, cost=Cost(200, 50)) == ["w1"] * 3  # busier, but no prefill
    assert place(cap, 1, cost=Cost(1_500, 50)) == ["w2"]  # the least loaded


class _Linear:
    """The model: placement as the rule reads (module notes), a pass over the workers
    per request."""

    def __init__(self, workers: list[WorkerView], long_prompt: int) -> None:
        self.rooms = [_Room(w, 0, i) for i, w in enumerate(w for w in workers if w.partitions)]
        self.owner = {p: room for room in self.rooms for p in room.view.partitions}
        self.long_prompt = long_prompt

    def fits(self, cost: Cost, keep: float) -> bool:
        return any(room.fits(cost, keep) for room in self.rooms)

    def place(self, cost: Cost, keep: float, key: str, session: str | None) -> tuple[str, int]:
        room, home = None, None
        if session is not None:
            partitions = sorted(self.owner)
            home = partitions[zlib.crc32(session.encode()) % len(partitions)]
            room = self.owner[home]
        if room is None or not room.fits(cost, keep):
            fitting = [r for r in self.rooms if r.fits(cost, keep)] or self.rooms
            if self.long_prompt and cost.prompt_tokens >= self.long_prompt:
                room = min(fitting, key=lambda r: r.load)
            else:
                room = min(fitting, key=lambda r: (r.prefill_steps, r.load))
        room.take(cost)
        parts = room.view.partitions
        if home not in parts:
            home = parts[zlib.crc32(key.encode()) % len(parts)]
        return room.view.worker_id, home


_worker = st.tuples(
    st.integers(1, 6),  # slots
    st.integers(0, 6),  # in flight
    st.sampled_from([0, 2_000, 4_000]),  # KV budget (0: not reported)
    st.integers(0, 4_000),  # KV in flight
    st.sampled_from([0, 1_000, 3_000]),  # prefill budget
    st.integers(0, 3_000),  # prefill queued
    st.sampled_from([0, 512, 1_000]),  # engine step tokens
    st.integers(0, 2),  # partitions owned
)
_request = st.tuples(
    st.builds(Cost, st.integers(1, 2_500), st.integers(1, 300)),
    st.booleans(),  # VIP
    st.sampled_from([None, "s1", "s2", "s3"]),  # session
)


@pytest.mark.parametrize("looks", [1, round_budget.LOOKS])
@settings(max_examples=300, deadline=None)
@given(
    workers=st.lists(_worker, min_size=1, max_size=8),
    requests=st.lists(_request, max_size=40),
    long_prompt=st.sampled_from([0, 800, 2_000]),
)
def test_placement_by_the_round_s_order_is_the_rule_s_pass_over_the_workers(
    looks: int,
    workers: list[tuple[int, int, int, int, int, int, int, int]],
    requests: list[tuple[Cost, bool, str | None]],
    long_prompt: int,
) -> None:
    """Every answer of ``fits`` and every placement (worker and partition), request
    after request, ties included, as a pass over the workers gives them — whether the
    order finds the worker or gives up after ``looks`` and passes over the pool."""
    with mock.patch.object(round_budget, "LOOKS", looks):
        _place_as_the_model_does(workers, requests, long_prompt)


def _place_as_the_model_does(
    workers: list[tuple[int, int, int, int, int, int, int, int]],
    requests: list[tuple[Cost, bool, str | None]],
    long_prompt: int,
) -> None:
    views, partition = [], 0
    for i, (slots, busy, kv, kv_used, prefill, queued, step, owned) in enumerate(workers):
        partitions = tuple(range(partition, partition + owned))
        partition += owned
        views.append(
            WorkerView(
                f"w{i}", partitions, slots, min(busy, slots), kv, kv_used, prefill, queued, step
            )
        )
    if not any(v.partitions for v in views):
        views[0] = dataclasses.replace(views[0], partitions=(partition,))
    unlimited = PoolView(workers=len(views), slots=10_000, in_pool=0, free=10_000)
    budget = RoundBudget(unlimited, RESERVE, workers=views, pool="main", long_prompt=long_prompt)
    model = _Linear(views, long_prompt)
    for i, (cost, vip, session) in enumerate(requests):
        keep = 0.0 if vip else RESERVE
        fits = budget.fits(cost, vip)
        assert fits == model.fits(cost, keep)
        if fits:
            placed = budget.take(cost, vip, key=f"r{i}", session=session)
            assert placed is not None
            assert (placed.worker_id, placed.partition) == model.place(cost, keep, f"r{i}", session)
