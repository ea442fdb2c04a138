"""Freshness of worker reports without comparing clocks (``policy.freshness``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.controller.policy.freshness import SAVE_TOLERANCE, WorkerClock, delay_of

MAX_AGE = 30.0


def clock() -> WorkerClock:
    return WorkerClock(max_age_s=MAX_AGE, refresh_s=300.0)


@given(st.floats(-1e6, 1e6), st.lists(st.floats(0.0, 0.5), min_size=1, max_size=50))
def test_live_reports_are_current_whatever_the_skew(skew: float, delays: list[float]) -> None:
    """A worker whose clock is ``skew`` off, reporting each second, read within half a
    second: every report is current."""
    c = clock()
    for i, delay in enumerate(delays):
        at = 1_000.0 + i + skew
        assert c.current(at, 1_000.0 + i + delay)


@given(st.floats(-1e6, 1e6), st.floats(60, 3600))
def test_a_backlog_read_after_downtime_is_stale_then_live_reports_are_current(
    skew: float, downtime: float
) -> None:
    c = clock()
    for i in range(10):  # before the controller went down
        assert c.current(i + skew, i + 0.1)
    back = 10 + downtime  # the controller is back; it reads the backlog in a few seconds
    written = [10 + k for k in range(int(downtime))]
    judged = [c.current(w + skew, back + 0.001 * k) for k, w in enumerate(written)]
    fresh = [w for w, ok in zip(written, judged, strict=True) if ok]
    assert fresh, "the newest of the backlog is current"
    assert min(fresh) >= back - MAX_AGE - 1  # nothing older than the bound counts
    assert c.current(back + 1 + skew, back + 1.05)  # live again


def test_a_worker_clock_stepped_back_is_trusted_again_after_max_age() -> None:
    c = clock()
    for i in range(10):
        assert c.current(float(i), i + 0.1)
    # NTP steps the worker's clock back by 120 s: its live reports look 120 s old
    stale = [c.current(i - 120.0, i + 0.1) for i in range(10, 10 + int(MAX_AGE))]
    assert not any(stale)
    assert c.current(10 + MAX_AGE + 1 - 120.0, 10 + MAX_AGE + 1.1)  # re-anchored
    assert c.current(10 + MAX_AGE + 2 - 120.0, 10 + MAX_AGE + 2.1)


def test_a_long_backlog_read_slowly_is_not_taken_for_a_stepped_clock() -> None:
    """Ten minutes of backlog read over 40 s (longer than the bound) while the worker
    goes on writing: its reports come faster than they were written, so the anchor
    stays; only the last half minute's reports are current."""
    c = clock()
    assert c.current(0.0, 0.0)
    # report k written at 100 + k, read at 700 + k / 16: age 600 - 15 k / 16
    judged = [c.current(100.0 + k, 700.0 + k / 16) for k in range(640)]
    assert not any(judged[:607])
    assert all(judged[608:])


def test_the_anchor_follows_the_least_delayed_report_and_refreshes() -> None:
    c = clock()
    c.current(0.0, 5.0)  # first, read 5 s late
    assert (c.anchor_at, c.anchor_now) == (0.0, 5.0)
    c.current(1.0, 1.5 + 1.0)  # read sooner: the better anchor
    assert (c.anchor_at, c.anchor_now) == (1.0, 2.5)
    c.current(2.0, 4.0)  # more delayed: current, anchor kept
    assert c.anchor_at == 1.0
    c.current(400.0, 401.6)  # the anchor is over refresh_s old: moved
    assert c.anchor_at == 400.0


@given(
    st.floats(-1e6, 1e6),
    st.lists(st.floats(0.0, 0.2), min_size=2, max_size=40),
    st.floats(0.0, 10.0),
)
def test_an_anchor_is_worth_saving_only_when_its_delay_moved_past_the_tolerance(
    skew: float, delays: list[float], later: float
) -> None:
    """Live reports whose delays wander within a few hundred milliseconds move the
    anchor (a new minimum) but never far enough from the saved one to be saved again; a
    delay that moves further (a clock step, a refresh after a slow spell) is."""
    tolerance = SAVE_TOLERANCE * MAX_AGE
    assert tolerance == 0.3
    c = clock()
    assert not c.moved_from(None)  # no anchor yet: nothing to save
    c.current(skew, delays[0])
    assert c.moved_from(None)  # the first anchor: always saved
    saved = c.anchor
    for i, delay in enumerate(delays[1:], start=1):
        c.current(i + skew, i + delay)
        assert not c.moved_from(saved)  # 0.2 s of spread is within the tolerance
    least = min(d - skew for d in delays)
    assert delay_of(c.anchor) == pytest.approx(least, abs=1e-6)  # yet the anchor followed
    stepped = WorkerClock(max_age_s=MAX_AGE, refresh_s=300.0)
    stepped.anchor_at, stepped.anchor_now = saved  # type: ignore[misc]
    stepped.current(100.0 + skew, 100.0 + delays[0] - tolerance - 0.01 - later)
    assert stepped.moved_from(saved)  # less delayed by more than the tolerance
