"""The adaptive batch limit: seed 1's algorithm, corrected."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.policy.batch import AdaptiveBatchLimit, BatchConfig, Samples
from services.controller.policy.decision import Decision, DecisionKind

pytestmark = pytest.mark.unit

SLA = 1000.0
FAST = BatchConfig(sla_ms=SLA, min_interval_s=0.0)


def run(
    controller: AdaptiveBatchLimit, latencies: Iterable[float], start: float = 0.0
) -> list[Decision[int]]:
    """One sample a second; the decisions made."""
    decisions = []
    for i, latency in enumerate(latencies):
        decision = controller.observe(start + i, Samples.one(latency))
        if decision is not None:
            decisions.append(decision)
    return decisions


def first_decision(initial: int, latency: float, max_num_seqs: int = 512) -> int | None:
    controller = AdaptiveBatchLimit("worker:w1", max_num_seqs, FAST, initial_limit=initial)
    decisions = run(controller, [latency] * 30)
    return decisions[0].new_state if decisions else None


@pytest.mark.parametrize(
    ("initial", "latency", "max_num_seqs", "expected"),
    [
        (64, 2 * SLA, 512, 44),  # 64 x 0.7 = 44.8, rounded down
        (5, 2 * SLA, 512, 4),  # 3.5 -> the floor
        (4, 2 * SLA, 512, None),  # at the floor: no change, no decision
        (4, 0.5 * SLA, 512, 5),  # 4.4 rounded up: small limits do grow
        (10, 0.5 * SLA, 512, 11),  # exactly 11, not 11.000000000000002 -> 12
        (120, 0.5 * SLA, 512, 128),  # 132 -> the ceiling
        (128, 0.5 * SLA, 512, None),
        (60, 0.5 * SLA, 64, 64),  # never above the engine's max_num_seqs
        (64, 0.9 * SLA, 512, None),  # between 0.8 x SLA and SLA: hold
    ],
)
def test_one_adjustment(
    initial: int, latency: float, max_num_seqs: int, expected: int | None
) -> None:
    assert first_decision(initial, latency, max_num_seqs) == expected


def test_ewma_is_pandas_adjusted_ewm_with_span_50() -> None:
    latencies = [float((i * 7919) % 1000 + 10) for i in range(120)]
    controller = AdaptiveBatchLimit("worker:w1", 64, FAST)
    alpha = 2 / 51
    for n, latency in enumerate(latencies, start=1):
        controller.observe(float(n), Samples.one(latency))
        weights = [(1 - alpha) ** (n - 1 - i) for i in range(n)]
        expected = sum(w * x for w, x in zip(weights, latencies[:n], strict=True)) / sum(weights)
        assert controller.ewma_ms == pytest.approx(expected, rel=1e-12)


def test_no_adjustment_before_the_volatility_window_is_full() -> None:
    controller = AdaptiveBatchLimit("worker:w1", 64, FAST)
    assert run(controller, [5 * SLA] * 29) == []
    decision = controller.observe(29.0, Samples.one(5 * SLA))
    assert decision is not None
    assert decision.new_state == 44


def test_decision_carries_the_seed_formula_as_evidence() -> None:
    latencies = [SLA * (1.5 + 0.2 * (i % 3)) for i in range(30)]
    controller = AdaptiveBatchLimit("worker:w1", 64, FAST)
    [decision] = run(controller, latencies, start=100.0)
    assert decision.kind is DecisionKind.BATCH_LIMIT
    assert (decision.scope, decision.at) == ("worker:w1", 129.0)
    assert (decision.previous_state, decision.new_state) == (64, 44)
    evidence = decision.evidence
    ewma = controller.ewma_ms
    assert ewma is not None
    std = statistics.stdev(latencies)
    assert evidence.metrics["latency_ewma_ms"] == ewma
    assert evidence.metrics["latency_std_ms"] == pytest.approx(std)
    assert evidence.metrics["volatility"] == pytest.approx(std / ewma)
    assert evidence.thresholds["adjusted_sla_ms"] == pytest.approx(SLA * (1 + std / ewma))
    assert evidence.thresholds["sla_ms"] == SLA
    assert evidence.window_s == 29.0  # the 30 samples span 29 s


def test_volatility_makes_a_noisy_worker_judged_less_eagerly() -> None:
    steady = AdaptiveBatchLimit("worker:w1", 64, FAST, initial_limit=32)
    noisy = AdaptiveBatchLimit("worker:w2", 64, FAST, initial_limit=32)
    [shrink] = run(steady, [1.1 * SLA] * 30)
    assert shrink.new_state < 32
    run(noisy, [0.6 * SLA if i % 2 else 1.6 * SLA for i in range(30)])  # same mean
    assert noisy.limit >= 32


def test_min_interval_between_adjustments() -> None:
    config = BatchConfig(sla_ms=SLA, min_interval_s=5.0)
    controller = AdaptiveBatchLimit("worker:w1", 128, config)
    decisions = run(controller, [3 * SLA] * 60)
    assert [d.at for d in decisions] == [29.0, 34.0, 39.0, 44.0, 49.0, 54.0, 59.0]
    assert [d.new_state for d in decisions] == [89, 62, 43, 30, 21, 14, 9]


def test_a_surge_after_a_healthy_period_shrinks_to_the_floor() -> None:
    """Rising latency after a healthy period: the limit reaches the floor."""
    controller = AdaptiveBatchLimit(
        "worker:w1", 64, BatchConfig(sla_ms=SLA, min_interval_s=1.0), initial_limit=16
    )
    run(controller, [0.3 * SLA] * 100)
    assert controller.limit == 64
    high = run(controller, [3 * SLA] * 100, start=100.0)
    assert controller.limit == 4
    assert all(d.new_state < d.previous_state for d in high)


@pytest.mark.parametrize(("initial", "expected"), [(1000, 64), (1, 4), (None, 64)])
def test_initial_limit_is_clamped(initial: int | None, expected: int) -> None:
    assert AdaptiveBatchLimit("worker:w1", 64, initial_limit=initial).limit == expected


def test_an_engine_below_the_floor_is_never_asked_for_more() -> None:
    controller = AdaptiveBatchLimit("worker:w1", 2, FAST)
    assert controller.limit == 2
    assert run(controller, [5 * SLA] * 50) == []
    assert run(controller, [0.1 * SLA] * 50, start=50.0) == []
    assert controller.limit == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"sla_ms": 0.0},
        {"ewma_span": 0},
        {"volatility_samples": 1},
        {"shrink_factor": 1.0},
        {"grow_factor": 1.0},
        {"grow_below": 0.0},
        {"floor": 0},
        {"floor": 200},
        {"min_interval_s": -1.0},
    ],
)
def test_invalid_config_is_rejected(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"must|need"):
        BatchConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("latency", [-1.0, float("nan"), float("inf")])
def test_invalid_latency_is_rejected(latency: float) -> None:
    with pytest.raises(ValueError, match="latency_mean_ms"):
        Samples.one(latency)
    with pytest.raises(ValueError, match="count"):
        Samples(0, 10.0)


def test_invalid_max_num_seqs_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        AdaptiveBatchLimit("worker:w1", 0)


@settings(max_examples=60, deadline=None)
@given(
    max_num_seqs=st.integers(1, 600),
    initial=st.integers(1, 1000),
    samples=st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 20 * SLA)), max_size=200),
)
def test_limit_always_within_floor_ceiling_and_max_num_seqs(
    max_num_seqs: int, initial: int, samples: list[tuple[float, float]]
) -> None:
    config = BatchConfig(sla_ms=SLA, min_interval_s=1.0)
    controller = AdaptiveBatchLimit("worker:w1", max_num_seqs, config, initial_limit=initial)
    cap = min(128, max_num_seqs)
    now = 0.0
    for gap, latency in samples:
        now += gap
        before = controller.limit
        decision = controller.observe(now, Samples.one(latency))
        assert min(4, cap) <= controller.limit <= cap
        if decision is not None:
            assert (decision.previous_state, decision.new_state) == (before, controller.limit)
            assert decision.new_state != before


@settings(max_examples=40, deadline=None)
@given(
    initial=st.integers(4, 128),
    base=st.floats(2.0, 20.0),
    slope=st.floats(0.0, 0.05),
    seed=st.integers(0, 2**32),
)
def test_shrinks_to_the_floor_under_rising_latency(
    initial: int, base: float, slope: float, seed: int
) -> None:
    """Latency from 2x the SLA up, rising by up to 5% of the SLA a sample, ±5% noise."""
    config = BatchConfig(sla_ms=SLA, min_interval_s=5.0)
    controller = AdaptiveBatchLimit("worker:w1", 128, config, initial_limit=initial)
    rng = random.Random(seed)
    latencies = [SLA * (base + slope * i) * rng.uniform(0.95, 1.05) for i in range(200)]
    decisions = run(controller, latencies)
    assert all(d.new_state < d.previous_state for d in decisions)
    assert controller.limit == 4


@settings(max_examples=40, deadline=None)
@given(
    initial=st.integers(4, 128),
    max_num_seqs=st.integers(4, 600),
    seed=st.integers(0, 2**32),
)
def test_grows_to_the_cap_while_healthy(initial: int, max_num_seqs: int, seed: int) -> None:
    """Any latencies up to half the SLA, however noisy."""
    config = BatchConfig(sla_ms=SLA, min_interval_s=1.0)
    controller = AdaptiveBatchLimit("worker:w1", max_num_seqs, config, initial_limit=initial)
    rng = random.Random(seed)
    decisions = run(controller, [rng.uniform(0.0, 0.5 * SLA) for _ in range(100)])
    assert all(d.new_state > d.previous_state for d in decisions)
    assert controller.limit == min(128, max_num_seqs)


# -- the per-token signals ---------------------------------------------------------

TOKENS = BatchConfig(sla_ms=SLA, min_interval_s=0.0, ttft_slo_ms=200.0, itl_slo_ms=50.0)


def run_tokens(
    controller: AdaptiveBatchLimit, samples: Iterable[tuple[float, float | None, float | None]]
) -> list[Decision[int]]:
    decisions = []
    for i, (latency, ttft, itl) in enumerate(samples):
        decision = controller.observe(float(i), Samples.one(latency, ttft, itl))
        if decision is not None:
            decisions.append(decision)
    return decisions


@pytest.mark.parametrize(
    ("ttft", "itl", "signal"),
    [(100.0, 120.0, "itl"), (900.0, 20.0, "ttft"), (900.0, 120.0, "ttft")],
)
def test_a_token_signal_over_its_slo_shrinks_though_the_latency_is_fine(
    ttft: float, itl: float, signal: str
) -> None:
    controller = AdaptiveBatchLimit("worker:w1", 512, TOKENS, initial_limit=64)
    (first, *_) = run_tokens(controller, [(0.5 * SLA, ttft, itl)] * 30)
    assert first.new_state == 44
    assert first.evidence.reason.startswith(f"{signal} EWMA")  # the worst, by its SLO
    assert first.evidence.metrics[f"{signal}_ewma_ms"] == pytest.approx(
        ttft if signal == "ttft" else itl
    )
    assert first.evidence.thresholds[f"{signal}_slo_ms"] in (200.0, 50.0)


def test_it_grows_only_while_every_signal_is_under_its_target() -> None:
    # Latency and TTFT well under, ITL at 0.9 of its SLO: hold.
    controller = AdaptiveBatchLimit("worker:w1", 512, TOKENS, initial_limit=32)
    assert run_tokens(controller, [(0.5 * SLA, 50.0, 45.0)] * 60) == []
    # All three under 0.8 of their targets: grow.
    decisions = run_tokens(controller, [(0.5 * SLA, 50.0, 30.0)] * 60)
    assert decisions[0].new_state == 36


def test_requests_without_token_figures_leave_the_token_signals_alone() -> None:
    """A static reply or a one-token answer has no ITL; an error may have no TTFT."""
    controller = AdaptiveBatchLimit("worker:w1", 512, TOKENS, initial_limit=64)
    assert run_tokens(controller, [(0.5 * SLA, None, None)] * 30)[0].new_state == 71


# -- the engine's reports -----------------------------------------------------------

ENGINE = BatchConfig(sla_ms=SLA, min_interval_s=5.0, preemption_hold_s=30.0, queue_hold_s=5.0)


def test_a_preemption_shrinks_at_once_with_the_engine_figures_as_evidence() -> None:
    controller = AdaptiveBatchLimit("worker:w1", 512, ENGINE, initial_limit=64)
    assert controller.observe_engine(0.0, preempted=0, waiting=3, kv_cache_usage=0.8) is None
    decision = controller.observe_engine(1.0, preempted=2, waiting=5, kv_cache_usage=0.99)
    assert decision is not None
    assert (decision.previous_state, decision.new_state) == (64, 44)
    assert decision.evidence.reason.startswith("2 preemptions since the engine's previous")
    assert decision.evidence.metrics == {
        "preemptions": 2.0,
        "kv_cache_usage": 0.99,
        "waiting": 5.0,
    }
    # The next preemption within min_interval_s waits; one after it shrinks again.
    assert controller.observe_engine(3.0, preempted=1, waiting=5, kv_cache_usage=0.99) is None
    again = controller.observe_engine(6.0, preempted=1, waiting=5, kv_cache_usage=0.99)
    assert again is not None
    assert again.new_state == 30


def test_no_growth_for_the_hold_after_a_preemption() -> None:
    controller = AdaptiveBatchLimit("worker:w1", 512, ENGINE, initial_limit=32)
    controller.observe_engine(0.0, preempted=0, waiting=0, kv_cache_usage=0.5)
    shrunk = controller.observe_engine(1.0, preempted=1, waiting=0, kv_cache_usage=0.99)
    assert shrunk is not None
    assert shrunk.new_state == 22
    # Fast requests, one a second: no growth before 1 + 30 s, growth right after.
    decisions = run(controller, [0.1 * SLA] * 40, start=2.0)
    assert decisions
    assert decisions[0].at == 31.0
    assert decisions[0].new_state == 25


def test_no_growth_while_the_engine_keeps_a_waiting_queue() -> None:
    controller = AdaptiveBatchLimit("worker:w1", 512, ENGINE, initial_limit=32)
    decisions: list[Decision[int]] = []
    for i in range(60):
        assert controller.observe_engine(float(i), 0, waiting=4, kv_cache_usage=0.7) is None
        decision = controller.observe(float(i), Samples.one(0.1 * SLA))
        if decision is not None:
            decisions.append(decision)
    assert decisions == []  # a queue held since t=0: the limit is not what binds
    # A queue that empties at each report is not a held queue: growth resumes.
    for i in range(60, 100):
        controller.observe_engine(float(i), 0, waiting=4 if i % 2 else 0, kv_cache_usage=0.7)
        decision = controller.observe(float(i), Samples.one(0.1 * SLA))
        if decision is not None:
            decisions.append(decision)
    assert decisions
    assert decisions[0].new_state == 36


def test_preemptions_never_take_the_limit_below_the_floor() -> None:
    controller = AdaptiveBatchLimit("worker:w1", 512, ENGINE, initial_limit=5)
    limits = []
    for i in range(10):
        decision = controller.observe_engine(10.0 * i, 3, waiting=9, kv_cache_usage=1.0)
        limits.append(controller.limit)
        assert decision is None or decision.new_state >= controller.floor
    assert set(limits) == {4}  # 5 x 0.7 -> the floor at once, and there it stays


def summary_of(latencies: list[float]) -> Samples:
    mean = statistics.fmean(latencies)
    return Samples(len(latencies), mean, math.fsum((x - mean) ** 2 for x in latencies))


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.floats(1.0, 20 * SLA), min_size=1, max_size=12), min_size=1, max_size=40
    )
)
def test_volatility_pools_summaries_exactly(groups: list[list[float]]) -> None:
    """Reports holding several requests pool into the standard deviation of the latest
    reports that hold at least 30 requests, as if every request had come alone."""
    controller = AdaptiveBatchLimit("worker:w1", 64, FAST, initial_limit=32)
    decision = None
    for i, group in enumerate(groups):
        decision = controller.observe(float(i), summary_of(group))
        if decision is not None:
            break
    kept: list[list[float]] = []
    for group in reversed(groups[: i + 1]):
        if sum(len(g) for g in kept) >= FAST.volatility_samples:
            break
        kept.insert(0, group)
    values = [x for g in kept for x in g]
    if len(values) < FAST.volatility_samples:
        assert decision is None
        return
    if decision is not None:
        assert decision.evidence.metrics["samples"] == len(values)
        assert decision.evidence.metrics["latency_std_ms"] == pytest.approx(
            statistics.stdev(values), rel=1e-9, abs=1e-9
        )


def test_a_summary_weighs_as_its_requests() -> None:
    """n requests of one mean move the EWMA as n requests one by one would."""
    one_by_one = AdaptiveBatchLimit("worker:w1", 64, FAST)
    together = AdaptiveBatchLimit("worker:w2", 64, FAST)
    for i in range(10):
        for _ in range(7):
            one_by_one.observe(float(i), Samples.one(100.0 + i))
        together.observe(float(i), Samples(7, 100.0 + i))
    assert together.ewma_ms == pytest.approx(one_by_one.ewma_ms, rel=1e-12)


def test_thirty_requests_in_one_report_are_enough_to_decide() -> None:
    controller = AdaptiveBatchLimit("worker:w1", 64, FAST, initial_limit=32)
    decision = controller.observe(0.0, summary_of([2 * SLA] * 30))
    assert decision is not None
    assert decision.new_state == 22
