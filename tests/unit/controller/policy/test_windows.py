"""Time-bucketed windows: quantiles within the sketch's accuracy, counts, expiry, merge."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from schemas import LatencySketch
from schemas.telemetry import SKETCH_MAX_KEY, SKETCH_RELATIVE_ACCURACY
from services.common.sketch import MAPPING, SketchBuilder, ddsketch_of
from services.controller.policy.decision import Reading
from services.controller.policy.windows import GaugeWindow, RequestWindow, ShareWindow

pytestmark = pytest.mark.unit

latencies = st.lists(st.floats(min_value=0.01, max_value=1e6), min_size=1, max_size=400)


def exact_quantile(values: list[float], q: float) -> float:
    """The order statistic DDSketch estimates: rank q * (n - 1) rounded down (numpy's
    ``method="lower"``)."""
    return sorted(values)[math.floor(q * (len(values) - 1))]


@settings(max_examples=80, deadline=None)
@given(values=latencies, accuracy=st.sampled_from([0.01, 0.02, 0.05]))
def test_quantiles_are_within_the_relative_accuracy(values: list[float], accuracy: float) -> None:
    window = RequestWindow(size_s=60.0, step_s=1.0, relative_accuracy=accuracy)
    for i, value in enumerate(values):  # spread over the window's buckets
        window.record(i * 59.0 / len(values), value, ok=True)
    stats = window.stats(59.0)
    assert stats.count == len(values)
    for q, estimate in ((0.50, stats.p50_ms), (0.99, stats.p99_ms)):
        exact = exact_quantile(values, q)
        assert estimate is not None
        assert abs(estimate - exact) <= accuracy * exact * (1 + 1e-9)


def test_median_agrees_with_statistics_on_an_odd_sample() -> None:
    values = [float(v) for v in range(1, 1002)]
    window = RequestWindow()
    for value in values:
        window.record(0.0, value, ok=True)
    median = window.stats(0.0).p50_ms
    assert median == pytest.approx(statistics.median(values), rel=0.01)


def test_counts_errors_and_error_rate() -> None:
    window = RequestWindow(size_s=60.0, step_s=10.0)
    for i in range(10):
        window.record(float(i), 100.0, ok=i >= 3)
    stats = window.stats(9.0)
    assert (stats.count, stats.errors, stats.error_rate) == (10, 3, 0.3)
    assert stats.error_rate_reading() == Reading(0.3, 10)


def test_empty_window_has_no_readings() -> None:
    stats = RequestWindow().stats(100.0)
    assert (stats.count, stats.error_rate, stats.p50_ms, stats.p99_ms) == (0, 0.0, None, None)
    assert stats.error_rate_reading() is None
    assert stats.p99_reading() is None


@pytest.mark.parametrize(
    ("recorded_at", "queried_at", "counted"),
    [
        (0.0, 60.0, True),  # exactly window_s old: still in
        (0.0, 69.9, True),  # its bucket [0, 10) still holds now - 60
        (0.0, 70.0, False),  # older than window_s + step_s: expired
        (9.9, 69.9, True),
        (9.9, 70.0, False),  # same bucket as t=0: expires with it
        (10.0, 70.0, True),
        (55.0, 55.0, True),  # the current, partly filled bucket counts
    ],
)
def test_buckets_expire_after_the_window(
    recorded_at: float, queried_at: float, counted: bool
) -> None:
    window = RequestWindow(size_s=60.0, step_s=10.0)
    window.record(recorded_at, 5.0, ok=False)
    assert window.stats(queried_at).count == int(counted)


@settings(max_examples=100, deadline=None)
@given(age=st.floats(min_value=0.0, max_value=200.0), now=st.floats(min_value=0.0, max_value=1e6))
def test_a_sample_counts_while_at_most_window_s_old_and_never_past_one_more_step(
    age: float, now: float
) -> None:
    window = GaugeWindow(size_s=60.0, step_s=10.0)
    window.record(now - age, 1.0)
    counted = window.stats(now).count == 1
    if age <= 60.0:
        assert counted
    if age > 70.0:
        assert not counted


def test_expired_buckets_are_dropped_not_just_hidden() -> None:
    window = RequestWindow(size_s=60.0, step_s=10.0)
    for t in range(0, 600, 5):
        window.record(float(t), 1.0, ok=True)
    assert len(window._buckets) == 7


def test_a_shorter_window_is_the_most_recent_buckets() -> None:
    window = RequestWindow(size_s=300.0, step_s=10.0)
    for t in range(300):
        window.record(float(t), 1000.0 if t < 230 else 10.0, ok=t >= 230)
    recent = window.stats(290.0, 60.0)  # buckets [230, 300)
    assert (recent.count, recent.errors) == (70, 0)
    assert recent.p99_ms == pytest.approx(10.0, rel=0.01)
    assert window.stats(299.0).count == 300


def test_window_longer_than_the_kept_history_is_rejected() -> None:
    with pytest.raises(ValueError, match="window_s"):
        RequestWindow(size_s=60.0, step_s=10.0).stats(0.0, 61.0)


def test_merged_workers_equal_one_window_over_all_requests() -> None:
    a, b, together = RequestWindow(), RequestWindow(), RequestWindow()
    for i in range(200):
        latency = float((i * 37) % 500 + 1)
        (a if i % 3 else b).record(float(i), latency, ok=i % 7 != 0)
        together.record(float(i), latency, ok=i % 7 != 0)
    pool = RequestWindow()
    pool.merge(a)
    pool.merge(b)
    assert pool.stats(199.0) == together.stats(199.0)
    assert a.stats(199.0).count + b.stats(199.0).count == 200  # sources unchanged


def test_windows_with_different_buckets_do_not_merge() -> None:
    with pytest.raises(ValueError, match="step_s"):
        RequestWindow(step_s=10.0).merge(RequestWindow(step_s=5.0))


def test_gauge_latest_min_max_mean_and_expiry() -> None:
    window = GaugeWindow(size_s=60.0, step_s=10.0)
    for t, value in [(0.0, 50.0), (20.0, 90.0), (30.0, 70.0), (45.0, 60.0)]:
        window.record(t, value)
    stats = window.stats(50.0)
    assert (stats.count, stats.latest, stats.minimum, stats.maximum) == (4, 60.0, 50.0, 90.0)
    assert stats.mean == 67.5
    assert stats.mean_reading() == Reading(67.5, 4)
    assert stats.max_reading() == Reading(90.0, 4)
    assert window.stats(50.0, 10.0).mean == 60.0
    assert window.stats(59.0, 9.0).count == 0  # only bucket [50, 60): nothing recorded
    later = window.stats(70.0)  # the sample at t=0 expired
    assert (later.count, later.minimum) == (3, 60.0)
    empty = window.stats(200.0)
    assert (empty.count, empty.latest, empty.mean, empty.mean_reading()) == (0, None, None, None)


def test_merged_gauges_keep_the_latest_sample_of_any_worker() -> None:
    a, b = GaugeWindow(), GaugeWindow()
    a.record(1.0, 10.0)
    a.record(3.0, 30.0)
    b.record(2.0, 20.0)
    pool = GaugeWindow()
    pool.merge(b)
    pool.merge(a)
    stats = pool.stats(3.0)
    assert (stats.latest, stats.minimum, stats.maximum, stats.mean) == (30.0, 10.0, 30.0, 20.0)


def test_share_window() -> None:
    window = ShareWindow(size_s=60.0, step_s=10.0)
    for i in range(10):
        window.record(float(i), hit=i < 4)
    stats = window.stats(9.0)
    assert (stats.total, stats.hits, stats.share) == (10, 4, 0.4)
    assert stats.share_reading() == Reading(0.4, 10)
    assert window.stats(100.0).share_reading() is None


@pytest.mark.parametrize(("size", "step"), [(10.0, 0.0), (5.0, 10.0)])
def test_bucket_geometry_is_validated(size: float, step: float) -> None:
    with pytest.raises(ValueError, match="step_s"):
        GaugeWindow(size_s=size, step_s=step)


def test_non_finite_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="latency_ms"):
        RequestWindow().record(0.0, -1.0, ok=True)
    with pytest.raises(ValueError, match="finite"):
        GaugeWindow().record(0.0, math.nan)


ops = st.lists(
    st.one_of(
        # a sample up to 30 s late against the latest query (it lands in a bucket a
        # cached merge may hold)
        st.tuples(st.just("record"), st.floats(-30.0, 0.0), st.floats(1.0, 5000.0), st.booleans()),
        # queries move forward only, as the controller's clock does
        st.tuples(st.just("query"), st.floats(0.0, 20.0), st.sampled_from([10.0, 30.0, 60.0])),
        st.tuples(st.just("merge"), st.floats(-30.0, 0.0), st.floats(1.0, 5000.0)),
    ),
    max_size=60,
)


@settings(max_examples=200)
@given(ops)
def test_repeated_queries_answer_as_a_fresh_fold_of_the_same_samples(
    steps: list[tuple[object, ...]],
) -> None:
    """Folds reuse the merge of closed buckets; whatever the order of samples (late ones
    included), merges and queries, a query — statistics or counts alone — answers as a
    window that never cached."""
    window = RequestWindow(size_s=60.0, step_s=5.0)
    history: list[tuple[float, float, bool]] = []
    clock = 100.0
    for step in steps:
        kind, offset = step[0], float(step[1])  # type: ignore[arg-type]
        if kind == "record":
            sample = (clock + offset, float(step[2]), bool(step[3]))  # type: ignore[arg-type]
            window.record(*sample)
            history.append(sample)
        elif kind == "merge":
            sample = (clock + offset, float(step[2]), True)  # type: ignore[arg-type]
            other = RequestWindow(size_s=60.0, step_s=5.0)
            other.record(*sample)
            window.merge(other)
            history.append(sample)
        else:
            clock += offset
            span = float(step[2])  # type: ignore[arg-type]
            fresh = RequestWindow(size_s=60.0, step_s=5.0)
            for sample in history:
                fresh.record(*sample)
            counted = window.counts(clock, span)  # first: each kind of read is its own
            got, want = window.stats(clock, span), fresh.stats(clock, span)
            assert (got.count, got.errors, got.p50_ms, got.p99_ms) == (
                want.count,
                want.errors,
                want.p50_ms,
                want.p99_ms,
            )
            assert (counted.window_s, counted.count, counted.errors) == (
                span,
                want.count,
                want.errors,
            )


@settings(max_examples=40, deadline=None)
@given(
    reports=st.lists(
        st.lists(st.tuples(st.floats(0.0, 120_000.0), st.booleans()), max_size=30),
        min_size=1,
        max_size=20,
    )
)
def test_reports_summarized_by_workers_read_as_their_requests_one_by_one(
    reports: list[list[tuple[float, bool]]],
) -> None:
    """Sketches built where requests finish, sent on the wire and merged here: the same
    counts, and quantiles within the relative accuracy, as a window fed every request."""
    summarized, one_by_one = RequestWindow(), RequestWindow()
    for second, requests in enumerate(reports):
        builder = SketchBuilder()
        for latency, ok in requests:
            builder.add(latency)
            one_by_one.record(float(second), latency, ok)
        wire = LatencySketch.model_validate_json(builder.wire().model_dump_json())
        failed = sum(1 for _, ok in requests if not ok)
        summarized.record_many(float(second), ddsketch_of(wire), failed)
    now = float(len(reports))
    a, b = summarized.stats(now), one_by_one.stats(now)
    assert (a.count, a.errors) == (b.count, b.errors)
    values = sorted(x for requests in reports for x, _ in requests)
    if not values:
        assert a.p99_ms is None
        return
    for quantile, got in ((0.5, a.p50_ms), (0.99, a.p99_ms)):
        exact = values[math.floor(quantile * (len(values) - 1))]
        assert got is not None
        assert got == pytest.approx(exact, rel=SKETCH_RELATIVE_ACCURACY, abs=1e-6)


def test_a_summary_cannot_report_more_errors_than_requests() -> None:
    builder = SketchBuilder()
    builder.add(10.0)
    with pytest.raises(ValueError, match="errors"):
        RequestWindow().record_many(0.0, ddsketch_of(builder.wire()), 2)


def test_values_beyond_the_wires_keys_count_in_the_outermost_bins() -> None:
    """A forged sketch cannot make a reader's dense store span more than the schema's
    keys, and a worker never builds one the schema refuses, whatever it measured."""
    builder = SketchBuilder()
    for value in (1e-30, 5.0, 1e30):
        builder.add(value)
    wire = builder.wire()
    assert [key for key, _ in wire.bins] == [-SKETCH_MAX_KEY, MAPPING.key(5.0), SKETCH_MAX_KEY]
    assert ddsketch_of(wire).count == 3
    with pytest.raises(ValidationError):
        LatencySketch(bins=((SKETCH_MAX_KEY + 1, 1),))
