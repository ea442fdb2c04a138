"""The pacing rule (capacity.py): table cases, then properties under random traffic."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import WorkerReport
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.round_budget import PoolView
from services.admission.policy.workers import CapacityConfig
from tests.admission_helpers import engine_stats, heartbeat

pytestmark = pytest.mark.unit


def fleet(slack: int = 0, timeout_s: float = 10.0, ttl_s: float = 600.0) -> FleetCapacity:
    return FleetCapacity(
        CapacityConfig(worker_timeout_s=timeout_s, slack=slack, ledger_ttl_s=ttl_s)
    )


def test_a_pool_without_live_workers_has_no_capacity() -> None:
    cap = fleet(slack=5)
    assert cap.free("main", now=0.0) == 0
    cap.report("w1", "small", batch_limit=8, in_flight=0, now=0.0)
    assert cap.free("main", now=0.0) == 0
    assert cap.free("small", now=0.0) == 8 + 5


def test_a_worker_that_moves_to_another_pool_counts_there_only() -> None:
    cap = fleet()
    cap.report("w1", "main", batch_limit=8, in_flight=0, now=0.0)
    cap.report("w1", "small", batch_limit=8, in_flight=0, now=1.0)
    assert (cap.free("main", now=1.0), cap.free("small", now=1.0)) == (0, 8)


@pytest.mark.parametrize(
    ("limits", "in_flight", "slack", "free"),
    [
        ([8], [0], 0, 8),
        ([8], [3], 0, 5),
        ([8], [8], 2, 2),
        ([8], [9], 0, 0),  # over its limit (a lowered batch limit): never negative
        ([4, 4], [4, 1], 1, 4),
        ([16, 8, 8], [0, 8, 8], 0, 16),
    ],
)
def test_free_is_the_live_workers_free_slots_plus_slack(
    limits: list[int], in_flight: list[int], slack: int, free: int
) -> None:
    cap = fleet(slack=slack)
    for i, (limit, n) in enumerate(zip(limits, in_flight, strict=True)):
        cap.report(f"w{i}", "main", batch_limit=limit, in_flight=n, now=1.0)
    assert cap.free("main", now=1.0) == free


def test_dispatches_count_until_a_report_or_a_completion_reflects_them() -> None:
    cap = fleet()
    cap.report("w1", "main", batch_limit=4, in_flight=0, now=0.0)
    for i in range(3):
        cap.dispatched("main", f"r{i}", now=1.0)
    assert cap.free("main", now=1.0) == 1
    # the worker picked them up and says so: still 3 in the pool, not 6
    cap.report("w1", "main", batch_limit=4, in_flight=3, now=2.0)
    assert cap.view("main", now=2.0).in_pool == 3
    cap.completed("w1", "r0", now=2.5)
    assert cap.free("main", now=2.5) == 2


def test_the_ledger_sees_records_still_waiting_in_kafka() -> None:
    """A report says in_flight=4 (full), but 6 of ours are in the pool: 2 wait in Kafka."""
    cap = fleet(slack=2)
    cap.report("w1", "main", batch_limit=4, in_flight=0, now=0.0)
    for i in range(6):
        cap.dispatched("main", f"r{i}", now=1.0)
    cap.report("w1", "main", batch_limit=4, in_flight=4, now=2.0)
    view = cap.view("main", now=2.0)
    assert (view.in_pool, view.free) == (6, 0)
    cap.completed("w1", "r0", now=3.0)  # its slot goes to a record already waiting
    assert cap.free("main", now=3.0) == 1


def test_other_instances_dispatches_are_seen_through_the_reports() -> None:
    cap = fleet(slack=1)
    cap.report("w1", "main", batch_limit=4, in_flight=4, now=0.0)  # none of them ours
    assert cap.free("main", now=0.0) == 1
    cap.completed("w1", "someone-elses", now=0.5)
    assert cap.free("main", now=0.5) == 2


def test_completions_after_a_report_free_slots_at_once() -> None:
    cap = fleet()
    cap.report("w1", "main", batch_limit=2, in_flight=2, now=0.0)
    cap.completed("w1", "x", now=0.1)
    cap.completed("w1", "y", now=0.2)
    assert cap.free("main", now=0.2) == 2
    cap.report("w1", "main", batch_limit=2, in_flight=1, now=0.3)  # a new report wins
    assert cap.free("main", now=0.3) == 1


@pytest.mark.parametrize(
    ("status", "counts"),
    [("serving", True), ("starting", True), ("draining", False), ("stopped", False)],
)
def test_only_absorbing_workers_count(status: str, counts: bool) -> None:
    cap = fleet()
    cap.report("w1", "main", batch_limit=8, in_flight=0, now=0.0, status=status)  # type: ignore[arg-type]
    assert cap.free("main", now=0.0) == (8 if counts else 0)
    # an EngineStats (no status) keeps the heartbeat's status
    cap.report("w1", "main", batch_limit=8, in_flight=0, now=1.0)
    assert cap.free("main", now=1.0) == (8 if counts else 0)


def test_a_silent_worker_stops_counting_and_comes_back_with_a_report() -> None:
    cap = fleet(timeout_s=10.0)
    cap.report("w1", "main", batch_limit=8, in_flight=0, now=0.0)
    cap.report("w2", "main", batch_limit=8, in_flight=0, now=5.0)
    assert cap.free("main", now=10.0) == 16
    assert cap.free("main", now=10.5) == 8  # w1 silent for more than 10 s
    cap.completed("w2", "r", now=14.0)  # a completion is a sign of life too
    assert cap.free("main", now=15.5) == 8
    assert cap.free("main", now=24.5) == 0
    cap.report("w1", "main", batch_limit=4, in_flight=0, now=30.0)
    assert cap.free("main", now=30.0) == 4


def test_an_isolated_worker_does_not_count_until_released() -> None:
    cap = fleet()
    cap.report("w1", "main", batch_limit=8, in_flight=0, now=0.0)
    cap.report("w2", "main", batch_limit=4, in_flight=0, now=0.0)
    cap.share("w1", 0.0)
    assert cap.view("main", now=0.0).workers == 1
    assert cap.free("main", now=0.0) == 4
    cap.share("w1", 1.0)
    assert cap.free("main", now=0.0) == 12


def test_a_rate_limited_worker_keeps_a_share_of_its_slots() -> None:
    cap = fleet()
    cap.report("w1", "main", batch_limit=8, in_flight=0, now=0.0)
    cap.report("w2", "main", batch_limit=4, in_flight=0, now=0.0)
    cap.share("w1", 0.5)
    assert cap.free("main", now=0.0) == 4 + 4
    assert cap.free("main", now=0.0, factor=0.5) == 2 + 2  # and the pool's factor on top
    cap.share("w2", 0.1)
    assert cap.free("main", now=0.0) == 4 + 1  # never below one slot while it counts
    with pytest.raises(ValueError, match="share"):
        cap.share("w1", 1.5)


@pytest.mark.parametrize(
    ("limits", "factor", "slots"),
    [([8], 0.5, 4), ([7], 0.5, 3), ([1], 0.5, 1), ([8, 3], 0.25, 3), ([8], 1.0, 8)],
)
def test_a_rate_limit_factor_scales_each_workers_slots_keeping_one(
    limits: list[int], factor: float, slots: int
) -> None:
    cap = fleet()
    for i, limit in enumerate(limits):
        cap.report(f"w{i}", "main", batch_limit=limit, in_flight=0, now=0.0)
    assert cap.view("main", now=0.0, factor=factor).slots == slots
    with pytest.raises(ValueError, match="factor"):
        cap.view("main", now=0.0, factor=1.5)


def test_the_ledger_forgets_what_never_completes() -> None:
    cap = fleet(ttl_s=60.0)
    cap.report("w1", "main", batch_limit=4, in_flight=0, now=0.0)
    cap.dispatched("main", "lost", now=0.0)
    cap.report("w1", "main", batch_limit=4, in_flight=0, now=50.0)
    assert cap.free("main", now=50.0) == 3
    cap.report("w1", "main", batch_limit=4, in_flight=0, now=61.0)
    assert cap.free("main", now=61.0) == 4


def test_a_completion_from_an_unknown_worker_still_clears_the_ledger() -> None:
    cap = fleet()
    cap.report("w1", "main", batch_limit=2, in_flight=0, now=0.0)
    cap.dispatched("main", "r1", now=0.1)
    cap.dispatched("main", "r1", now=0.2)  # a re-dispatch counts once
    assert cap.view("main", now=0.2).in_pool == 1
    cap.completed("w-unknown", "r1", now=0.3)
    assert cap.view("main", now=0.3).in_pool == 0


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="positive"):
        CapacityConfig(worker_timeout_s=0)
    with pytest.raises(ValueError, match="negative"):
        CapacityConfig(slack=-1)


events = st.lists(
    st.one_of(
        st.tuples(st.just("report"), st.integers(0, 2), st.integers(1, 16), st.integers(0, 20)),
        st.tuples(st.just("done"), st.integers(0, 2), st.integers(0, 40), st.just(0)),
        st.tuples(st.just("dispatch"), st.integers(0, 40), st.just(0), st.just(0)),
        st.tuples(st.just("share"), st.integers(0, 2), st.sampled_from([0, 1, 5, 10]), st.just(0)),
        st.tuples(st.just("wait"), st.integers(0, 30), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@given(events, st.integers(0, 4), st.floats(0.1, 1.0))
def test_free_stays_within_bounds(
    steps: list[tuple[str, int, int, int]], slack: int, factor: float
) -> None:
    cap = fleet(slack=slack, timeout_s=10.0, ttl_s=100.0)
    now = 0.0
    for kind, a, b, c in steps:
        if kind == "report":
            cap.report(f"w{a}", "main", batch_limit=int(b), in_flight=c, now=now)
        elif kind == "done":
            cap.completed(f"w{a}", f"r{b}", now=now)
        elif kind == "dispatch":
            cap.dispatched("main", f"r{a}", now=now)
        elif kind == "share":
            cap.share(f"w{a}", b / 10)
        else:
            now += a
        view = cap.view("main", now=now, factor=factor)
        assert 0 <= view.free <= view.slots + slack
        assert view.free == 0 or view.workers > 0


@settings(max_examples=200)
@given(
    st.integers(1, 8),
    st.integers(0, 3),
    st.lists(st.tuples(st.booleans(), st.lists(st.booleans(), max_size=8)), max_size=80),
)
def test_one_instance_never_queues_more_than_the_slack_in_kafka(
    limit: int, slack: int, rounds: list[tuple[bool, list[bool]]]
) -> None:
    """A simulated worker (limit ``limit``) fetches from a simulated dispatch topic, finishes
    some of its requests each round and reports only sometimes. However stale its
    reports, once it has fetched, the records left waiting in Kafka never exceed the
    slack: the backlog stays in admission, where priority decides."""
    cap = fleet(slack=slack)
    kafka: deque[str] = deque()
    running: list[str] = []
    now, n = 0.0, 0
    cap.report("w", "main", batch_limit=limit, in_flight=0, now=now)
    for reports, finishes in rounds:
        now += 0.1
        for _ in range(cap.free("main", now=now)):  # admission dispatches into free slots
            rid = f"r{n}"
            n += 1
            cap.dispatched("main", rid, now=now)
            kafka.append(rid)
        while kafka and len(running) < limit:  # the worker fetches
            running.append(kafka.popleft())
        assert len(kafka) <= slack
        for rid, done in list(zip(running, finishes, strict=False)):
            if done:
                running.remove(rid)
                cap.completed("w", rid, now=now)
        if reports:
            cap.report("w", "main", batch_limit=limit, in_flight=len(running), now=now)


def test_observe_reads_each_kind_of_telemetry() -> None:
    cap = fleet()
    cap.observe(engine_stats("w1", "main", batch_limit=8, in_flight=2), now=0.0)
    cap.observe(heartbeat("w2", status="starting"), now=0.0)
    assert slots_of(cap.view("main", now=0.0)) == PoolView(2, slots=16, in_pool=2, free=14)
    report = WorkerReport(
        worker_id="w2", pool="main", at=1.0, heartbeat=heartbeat("w2", status="draining")
    )
    cap.observe(report, now=0.5)
    cap.dispatched("main", "r1", 0.6)
    assert slots_of(cap.view("main", now=0.6)) == PoolView(1, slots=8, in_pool=3, free=5)
    cap.completed("w1", "r1", now=0.7)  # the ledger's and a reported slot
    assert slots_of(cap.view("main", now=0.7)) == PoolView(1, slots=8, in_pool=1, free=7)


def test_numbered_completions_count_only_against_reports_that_do_not_reflect_them() -> None:
    """Completions and reports are separate topics, read in any order: a completion the
    report already reflects (its ``seq`` <= the report's ``completed_total``) frees
    nothing twice, whichever came first."""
    cap = fleet()

    def report(in_flight: int, completed_total: int) -> None:
        cap.report(
            "w1",
            "main",
            batch_limit=8,
            in_flight=in_flight,
            now=0.0,
            completed_total=completed_total,
        )

    report(in_flight=4, completed_total=10)
    cap.completed("w1", "a", now=0.1, seq=11)  # after the report: one slot freed
    assert cap.view("main", now=0.1).in_pool == 3
    cap.completed("w1", "b", now=0.1, seq=12)
    report(in_flight=3, completed_total=11)  # reflects 11, not 12 yet
    assert cap.view("main", now=0.1).in_pool == 2
    report(in_flight=2, completed_total=12)  # the completion came before this report
    assert cap.view("main", now=0.1).in_pool == 2
    report(in_flight=5, completed_total=0)  # a restarted worker counts from 0 again
    cap.completed("w1", "c", now=0.2, seq=1)
    assert cap.view("main", now=0.2).in_pool == 4


def slots_of(view: PoolView) -> PoolView:
    """The batch-slot figures alone."""
    return PoolView(view.workers, view.slots, view.in_pool, view.free)


def test_a_pools_context_length_is_the_smallest_its_live_workers_report() -> None:
    cap = fleet(timeout_s=10.0)
    assert cap.model_lens(now=0.0) == {}
    cap.observe(engine_stats("w1", "main", 8, max_model_len=4096), now=0.0)
    cap.observe(engine_stats("w2", "main", 8, max_model_len=2048), now=1.0)
    cap.observe(engine_stats("s1", "small", 8), now=1.0)  # an engine that does not say
    assert cap.model_lens(now=1.0) == {"main": 2048}
    cap.observe(engine_stats("w1", "main", 8, max_model_len=4096), now=8.0)
    # w2 fell silent: what is left of the pool can run 4096
    assert cap.model_lens(now=12.0) == {"main": 4096}
    cap.observe(heartbeat("w1", "main", status="draining"), now=12.0)
    assert cap.model_lens(now=12.0) == {}


def test_a_worker_heard_from_after_its_timeout_comes_back_as_a_new_one() -> None:
    cap = fleet(timeout_s=10.0)
    cap.observe(engine_stats("w1", "main", 8, max_model_len=2048), now=0.0)
    assert cap.model_lens(now=9.9) == {"main": 2048}  # looked at just before its timeout
    cap.observe(heartbeat("w1", "main"), now=10.5)  # silent 10.5 s: forgotten, back as new
    assert cap.model_lens(now=10.5) == {}  # its context length not known again yet
    assert cap.free("main", now=10.5) == 8


lens_ops = st.lists(
    st.one_of(
        # (kind, worker, pool, figure, seconds since the last op)
        st.tuples(
            st.just("engine"),
            st.sampled_from(["w1", "w2", "w3"]),
            st.sampled_from(["main", "small"]),
            st.sampled_from([0, 2048, 4096, 8192]),  # 0: an engine that does not say
            st.sampled_from([0.0, 0.5, 3.0, 9.9, 10.0, 10.1]),
        ),
        st.tuples(
            st.just("status"),
            st.sampled_from(["w1", "w2", "w3"]),
            st.sampled_from(["main", "small"]),
            st.sampled_from(["starting", "serving", "draining", "stopped"]),
            st.sampled_from([0.0, 0.5, 3.0, 10.0, 10.1]),
        ),
        st.tuples(
            st.just("completed"),
            st.sampled_from(["w1", "w2", "w3"]),
            st.just(""),
            st.just(0),
            st.sampled_from([0.0, 2.0, 9.9, 10.1]),
        ),
        st.tuples(
            st.just("share"),
            st.sampled_from(["w1", "w2", "w3"]),
            st.just(""),
            st.sampled_from([0.0, 0.5, 1.0]),
            st.just(0.0),
        ),
        st.tuples(
            st.just("wait"), st.just(""), st.just(""), st.just(0), st.sampled_from([1.0, 5.0, 10.1])
        ),
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(ops=lens_ops)
def test_context_lengths_asked_between_any_changes_are_those_of_the_live_workers(
    ops: list[tuple[str, str, str, object, float]],
) -> None:
    """``model_lens`` is asked for every batch and remembers its walk of the fleet: asked
    after any change, or after time alone, it answers as a walk of every worker would.
    A worker heard from after its timeout is a new one (its context length unknown)."""
    cap = fleet(timeout_s=10.0)
    heard: dict[str, float] = {}
    pool_of: dict[str, str] = {}
    status: dict[str, str] = {}
    length: dict[str, int] = {}
    share: dict[str, float] = {}
    now = 0.0
    for kind, worker, pool, figure, step in ops:
        now += step
        if kind in ("engine", "status", "completed") and now - heard.get(worker, now) > 10.0:
            for known in (heard, pool_of, status, length):  # silent: heard from anew
                known.pop(worker, None)  # type: ignore[attr-defined]
        if kind == "engine":
            cap.observe(engine_stats(worker, pool, 8, max_model_len=figure), now=now)  # type: ignore[arg-type]
            heard[worker], pool_of[worker] = now, pool
            status.setdefault(worker, "serving")
            if figure:
                length[worker] = figure  # type: ignore[assignment]
        elif kind == "status":
            cap.observe(heartbeat(worker, pool, status=figure), now=now)  # type: ignore[arg-type]
            heard[worker], pool_of[worker], status[worker] = now, pool, figure  # type: ignore[assignment]
        elif kind == "completed":
            cap.completed(worker, "r", now=now)
            if worker in heard:
                heard[worker] = now
        elif kind == "share":
            cap.share(worker, figure)  # type: ignore[arg-type]
            share[worker] = figure  # type: ignore[assignment]
        expected: dict[str, int] = {}
        for w, n in length.items():
            live = (
                w in heard
                and now - heard[w] <= 10.0
                and status[w] in ("starting", "serving")
                and share.get(w, 1.0) > 0
            )
            if live:
                expected[pool_of[w]] = min(expected.get(pool_of[w], n), n)
        assert cap.model_lens(now) == expected
