from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from schemas import BatchLimit, DegradationLevel, Evidence
from services.common.clock import ManualClock
from services.common.control import ControlState

EVIDENCE = Evidence(reason="test")


def limit(seq: int, value: int, worker: str = "w1") -> BatchLimit:
    return BatchLimit(
        scope=f"worker:{worker}",
        seq=seq,
        issued_at=1.0,
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
        DegradationLevel(scope="worker:w1", seq=1, issued_at=1.0, level=2, evidence=EVIDENCE)
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
