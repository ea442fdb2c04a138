from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.offsets import OffsetTracker


def test_commits_only_up_to_the_first_unfinished_offset() -> None:
    t: OffsetTracker[int] = OffsetTracker()
    for off in (10, 11, 12):
        t.track(0, off)
    t.done(0, 11)
    assert t.take_commits() == {}
    t.done(0, 10)
    assert t.take_commits() == {0: 12}
    assert t.take_commits() == {}
    t.done(0, 12)
    assert t.take_commits() == {0: 13}
    assert t.pending() == 0


def test_out_of_order_tracking_is_refused() -> None:
    t: OffsetTracker[str] = OffsetTracker()
    t.track("p", 5)
    with pytest.raises(ValueError, match="out of order"):
        t.track("p", 5)


def test_forgotten_partitions_commit_nothing() -> None:
    t: OffsetTracker[int] = OffsetTracker()
    t.track(1, 0)
    t.forget([1])
    t.done(1, 0)
    assert t.take_commits() == {}


@given(
    st.integers(1, 40).flatmap(
        lambda n: st.tuples(st.just(n), st.permutations(range(n)), st.integers(0, n))
    )
)
def test_commit_point_never_passes_an_unfinished_record(case: tuple[int, list[int], int]) -> None:
    n, order, finished = case
    t: OffsetTracker[int] = OffsetTracker()
    for off in range(n):
        t.track(0, off)
    for off in order[:finished]:
        t.done(0, off)
    done = set(order[:finished])
    expected = next((off for off in range(n) if off not in done), n)
    assert t.take_commits().get(0, 0) == expected
    assert t.pending(0) == n - finished
