"""``seawall load``'s figures: percentiles, per-class summaries, counts, live view."""

from __future__ import annotations

import json
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import Priority, ReasonCode, ReplyStatus
from seawall.load.stats import (
    ALL,
    Outcome,
    document,
    live,
    percentile,
    summarize,
)

pytestmark = pytest.mark.unit

samples = st.lists(st.floats(0, 1e6, allow_nan=False), min_size=2, max_size=200)


@given(samples, st.integers(1, 99))
def test_percentile_matches_the_standard_library(values: list[float], q: int) -> None:
    reference = statistics.quantiles(values, n=100, method="inclusive")[q - 1]
    assert percentile(values, q) == pytest.approx(reference, rel=1e-9, abs=1e-9)


@given(samples)
def test_percentile_ends_and_middle(values: list[float]) -> None:
    assert percentile(values, 0) == min(values)
    assert percentile(values, 100) == max(values)
    assert percentile(values, 50) == pytest.approx(statistics.median(values), rel=1e-9, abs=1e-9)


def test_percentile_small_cases() -> None:
    assert percentile([], 99) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 95) == pytest.approx(
        9.55
    )
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


statuses = st.sampled_from([*ReplyStatus, None])


@st.composite
def outcomes(draw: st.DrawFn) -> list[Outcome]:
    n = draw(st.integers(0, 60))
    result = []
    for i in range(n):
        status = draw(statuses)
        sent = draw(st.floats(0, 100))
        latency = draw(st.floats(0.001, 30))
        share = draw(st.one_of(st.none(), st.floats(0, 1)))
        first = None if share is None else sent + share * latency
        result.append(
            Outcome(
                index=i,
                priority=draw(st.sampled_from(Priority)),
                sent_at=sent,
                done_at=sent + latency,
                status=status,
                reason=draw(st.sampled_from(ReasonCode)) if status is not None else ReasonCode.NONE,
                first_chunk_at=first if status is not None else None,
                completion_tokens=draw(st.integers(0, 100)),
                attempts=draw(st.integers(1, 4)),
                cause="" if status is not None else draw(st.sampled_from(["timeout", "drain"])),
            )
        )
    return result


# Many draws per example: no per-example deadline on a busy machine.
@settings(deadline=None)
@given(outcomes(), st.integers(0, 10))
def test_counts_add_up(records: list[Outcome], duplicates: int) -> None:
    s = summarize(records, duplicates=duplicates)
    assert s.submitted == len(records) == s.terminal_replies + s.lost
    assert s.duplicates == duplicates
    assert s.retried == sum(1 for o in records if o.status is not None and o.attempts > 1)
    assert sum(s.by_status.values()) == s.terminal_replies
    assert sum(s.lost_by_cause.values()) == s.lost
    assert sum(s.rejections_by_reason.values()) == s.by_status.get("rejected", 0)
    per_class = [c for name, c in s.classes.items() if name != ALL]
    assert sum(c.submitted for c in per_class) == s.submitted
    if records:
        assert s.classes[ALL].submitted == s.submitted
        assert sum(s.classes[ALL].by_status.values()) == s.submitted
    assert s.goodput_rps <= s.throughput_rps
    json.dumps(document(s, {"rate": 1.0}, {"duplicates": duplicates}))


def _served(i: int, priority: Priority, latency: float, ttft: float) -> Outcome:
    return Outcome(i, priority, float(i), i + latency, ReplyStatus.OK, first_chunk_at=i + ttft,
                   completion_tokens=10)  # fmt: skip


def test_quantiles_are_per_class_over_served_requests_only() -> None:
    vip = [_served(i, Priority.VIP, latency=(i + 1) / 100, ttft=0.01) for i in range(100)]
    rejected = Outcome(
        100, Priority.VIP, 0.0, 0.001, ReplyStatus.REJECTED, ReasonCode.OVERLOADED, attempts=4
    )
    bulk = [_served(101, Priority.BULK, latency=5.0, ttft=1.0)]
    s = summarize([*vip, rejected, *bulk], duplicates=0)
    assert set(s.classes) == {"vip", "bulk", ALL}
    assert s.classes["vip"].latency_ms.p50 == pytest.approx(505.0)
    assert s.classes["vip"].latency_ms.p99 == pytest.approx(990.1)
    assert s.classes["vip"].ttft_ms.p95 == pytest.approx(10.0)
    assert s.classes["vip"].by_status == {"ok": 100, "rejected": 1}
    assert s.classes["bulk"].latency_ms.p99 == pytest.approx(5000.0)
    assert s.classes["bulk"].ttft_ms.p50 == pytest.approx(1000.0)
    assert s.rejections_by_reason == {"overloaded": 1}
    assert s.retried == 1
    assert s.elapsed_s == pytest.approx(106.0)
    assert s.throughput_rps == pytest.approx(102 / 106)
    assert s.goodput_rps == pytest.approx(101 / 106)
    assert s.tokens_per_s == pytest.approx(1010 / 106)


def test_lost_requests_have_no_latency_and_count_by_cause() -> None:
    lost = [
        Outcome(0, Priority.STANDARD, 0.0, 30.0, None, cause="timeout"),
        Outcome(1, Priority.STANDARD, 1.0, 40.0, None, cause="timeout"),
        Outcome(2, Priority.STANDARD, 2.0, 40.0, None, cause="no reply by the end of the drain"),
    ]
    s = summarize(lost, duplicates=2)
    assert (s.submitted, s.terminal_replies, s.lost) == (3, 0, 3)
    assert s.lost_by_cause == {"timeout": 2, "no reply by the end of the drain": 1}
    assert s.classes["standard"].latency_ms.p99 is None
    assert s.classes["standard"].by_status == {"lost": 3}
    assert s.elapsed_s == 0.0
    assert s.throughput_rps == 0.0


def test_document_is_json_with_the_counts_at_the_top() -> None:
    s = summarize([_served(0, Priority.VIP, 0.5, 0.1)], duplicates=1)
    doc = json.loads(json.dumps(document(s, {"profile": "steady"}, {"retries": 0})))
    assert doc["config"] == {"profile": "steady"}
    assert doc["client"] == {"retries": 0}
    assert (doc["submitted"], doc["terminal_replies"], doc["duplicates"], doc["lost"]) == (
        1,
        1,
        1,
        0,
    )
    assert doc["classes"]["vip"]["latency_ms"]["p99"] == pytest.approx(500.0)


def test_live_figures_use_the_recent_window() -> None:
    sent = [float(t) for t in range(20)]
    finished = [
        _served(i, Priority.VIP, latency=0.5 if i < 15 else 2.0, ttft=0.1) for i in range(18)
    ]
    finished.insert(-1, Outcome(18, Priority.BULK, 18.0, 18.6, ReplyStatus.REJECTED))
    assert [o.done_at for o in finished] == sorted(o.done_at for o in finished)
    view = live(sent, finished, now=20.0, window_s=5.0)
    assert (view.submitted, view.in_flight, view.done, view.lost, view.rejected) == (
        20,
        1,
        19,
        0,
        1,
    )
    assert view.send_rate == pytest.approx(5 / 5)  # sent at 15..19
    assert view.done_rate == pytest.approx(4 / 5)  # done at 17, 18, 18.6, 19 (not 14.5)
    assert view.p99_ms == pytest.approx(2000.0)  # the rejection is not served


def test_live_figures_before_anything_happened() -> None:
    view = live([], [], now=0.0)
    assert (view.submitted, view.in_flight, view.done, view.send_rate, view.p99_ms) == (
        0,
        0,
        0,
        0.0,
        None,
    )
