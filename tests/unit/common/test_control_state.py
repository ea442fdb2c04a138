from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from schemas import BatchLimit, BreakerState, DegradationLevel, Evidence
from seawall_client.clock import ManualClock
from services.common.control_state import ControlState, in_force

EVIDENCE = Evidence(reason="test")
T0 = ManualClock().time()


def limit(
    seq: int, value: int, worker: str = "w1", issued_at: float = T0, valid_for_s: float = 60.0
) -> BatchLimit:
    return BatchLimit(
        scope=f"worker:{worker}",
        seq=seq,
        issued_at=issued_at,
        valid_for_s=valid_for_s,
        worker_id=worker,
        limit=value,
        evidence=EVIDENCE,
    )


def test_latest_sequence_wins_and_stale_events_are_ignored() -> None:
    state = ControlState(ManualClock())
    assert state.apply(limit(2, 32))
    assert not state.apply(limit(1, 8))
    assert not state.apply(limit(2, 8))  # a duplicate seq never replaces
    got = state.get(BatchLimit, "worker:w1")
    assert got is not None
    assert got.limit == 32


def test_kinds_and_scopes_are_separate() -> None:
    state = ControlState(ManualClock())
    state.apply(limit(5, 16, "w1"))
    state.apply(limit(1, 64, "w2"))
    state.apply(
        DegradationLevel(scope="worker:w1", seq=1, issued_at=T0, level=2, evidence=EVIDENCE)
    )
    assert {e.limit for e in state.all(BatchLimit)} == {16, 64}
    assert state.get(DegradationLevel, "worker:w1") is not None
    assert state.get(DegradationLevel, "worker:w2") is None


def test_age_grows_while_the_controller_is_silent() -> None:
    clock = ManualClock()
    state = ControlState(clock)
    assert state.age_s() is None
    state.apply(limit(1, 8))
    clock.advance(7.5)
    assert state.age_s() == 7.5
    state.apply(limit(1, 8))  # a re-publication still proves the controller alive
    assert state.age_s() == 0


@given(st.permutations(list(range(1, 30))))
def test_any_delivery_order_converges_on_the_highest_sequence(order: list[int]) -> None:
    state = ControlState(ManualClock())
    for seq in order + order[:5]:  # with duplicates, as at-least-once delivers them
        state.apply(limit(seq, seq))
    got = state.get(BatchLimit, "worker:w1")
    assert got is not None
    assert got.seq == 29


def test_a_decision_expires_once_valid_for_s_has_passed_without_a_republication() -> None:
    clock = ManualClock()
    state = ControlState(clock)
    state.apply(limit(1, 8, valid_for_s=10))
    clock.advance(9.9)
    assert state.get(BatchLimit, "worker:w1") is not None
    assert state.expire() == []
    clock.advance(0.1)  # issued_at + valid_for_s itself is past
    assert state.get(BatchLimit, "worker:w1") is None  # the default applies again
    assert state.all(BatchLimit) == []
    gone = state.expire()
    assert [e.seq for e in gone] == [1]
    assert state.expire() == []  # returned once


def test_a_republication_extends_the_decision_and_nothing_older_returns() -> None:
    clock = ManualClock()
    state = ControlState(clock)
    state.apply(limit(1, 8, valid_for_s=10))
    clock.advance(8)
    # re-published: same issued_at, a new seq, a longer valid_for_s
    assert state.apply(limit(2, 8, valid_for_s=20))
    clock.advance(5)
    assert state.get(BatchLimit, "worker:w1") is not None
    clock.advance(10)
    assert [e.seq for e in state.expire()] == [2]
    assert not state.apply(limit(1, 8, valid_for_s=10))  # a late duplicate stays out
    assert state.apply(limit(3, 4, issued_at=clock.time()))  # a fresh decision is taken
    got = state.get(BatchLimit, "worker:w1")
    assert got is not None
    assert got.limit == 4


def test_the_cli_view_keeps_expired_decisions() -> None:
    clock = ManualClock()
    state = ControlState(clock, in_force_only=False)
    breaker = BreakerState(
        scope="pool:main", seq=1, issued_at=T0, state="open", valid_for_s=1, evidence=EVIDENCE
    )
    state.apply(breaker)
    clock.advance(5)
    assert not in_force(breaker, clock.time())
    assert state.get(BreakerState, "pool:main") == breaker


_APPLY = st.tuples(
    st.just("apply"),
    st.sampled_from(["w1", "w2", "w3"]),
    st.integers(-2, 3),  # seq, against the last one sent for the key: mostly newer
    st.integers(-60, 60).map(lambda half_s: half_s / 2),  # issued_at, from the start
    st.sampled_from([0.5, 5.0, 60.0]),  # valid_for_s
)
_STEPS = st.lists(
    st.one_of(
        # Applies weigh most: re-publications pile up until the heap is rebuilt.
        _APPLY,
        _APPLY,
        _APPLY,
        # Halves of a second (exact in binary): the clock lands on deadlines exactly.
        st.tuples(st.just("advance"), st.integers(0, 80).map(lambda half_s: half_s / 2)),
        st.tuples(st.just("expire")),
    ),
    min_size=30,
    max_size=150,
)


@given(_STEPS)
def test_expire_drops_exactly_what_a_scan_of_every_decision_would(steps: list[tuple]) -> None:
    """``expire`` pops due deadlines from a heap (and rebuilds it as re-publications
    pile up); a naive model scans every decision kept. They must agree on what is
    kept, what expires and what is refused, whatever the order of events and time."""
    clock = ManualClock()
    state = ControlState(clock)
    latest: dict[str, BatchLimit] = {}
    floor: dict[str, int] = {}
    sent: dict[str, int] = {}
    for step in steps:
        if step[0] == "apply":
            _, worker, step_seq, offset, valid = step
            seq = sent[worker] = max(1, sent.get(worker, 0) + step_seq)
            event = limit(seq, seq, worker, T0 + offset, valid)
            key = event.control_key
            kept = (key not in latest or latest[key].seq < seq) and seq > floor.get(key, -1)
            if kept:
                latest[key] = event
            assert state.apply(event) == kept
        elif step[0] == "advance":
            clock.advance(step[1])
        else:
            now = clock.time()
            expected = {k: e for k, e in latest.items() if not in_force(e, now)}
            for k, e in expected.items():
                floor[k] = e.seq
                del latest[k]
            assert {e.control_key: e.seq for e in state.expire()} == {
                k: e.seq for k, e in expected.items()
            }
        now = clock.time()
        assert sorted(e.control_key for e in state.all(BatchLimit)) == sorted(
            k for k, e in latest.items() if in_force(e, now)
        )


def test_an_event_from_the_future_is_refused_and_counted() -> None:
    """Dated an hour ahead, or numbered past the hybrid clock's microseconds: refused, so
    that it cannot hold its key against the genuine decisions to come."""
    clock = ManualClock()
    state = ControlState(clock)
    now_us = int(clock.time() * 1_000_000)
    assert not state.apply(limit(now_us, 1, issued_at=clock.time() + 3600))
    assert not state.apply(limit(2**62, 1))
    assert state.refused == 2
    assert state.get(BatchLimit, "worker:w1") is None
    assert state.apply(limit(now_us, 32, issued_at=clock.time() + 5))  # a little skew is fine
    assert state.apply(limit(now_us + 1, 16))
    got = state.get(BatchLimit, "worker:w1")
    assert got is not None
    assert got.limit == 16
