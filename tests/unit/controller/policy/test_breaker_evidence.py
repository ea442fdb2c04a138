"""The breaker's error-rate row decides on evidence: simulated workers whose failures
complete faster than their successes (as a failing engine's do), fed through the real
request window and breaker. A worker failing 20 % of its requests is never isolated at
the default 30 % trip; one failing 50 % is, within seconds; on the rate alone (no
confidence bound) the 20 % worker was isolated in a third of the runs."""

from __future__ import annotations

import dataclasses
import random
import statistics

import pytest

from services.controller.policy.breaker import (
    Breaker,
    BreakerConfig,
    Circuit,
    breaker_readings,
)
from services.controller.policy.windows import GaugeWindow, RequestWindow, wilson_lower

pytestmark = pytest.mark.unit

RATE = 2.0  # requests a second
TICK_S = 0.5  # how often the controller looks


def completions_until_tripped(
    error_rate: float, seed: int, duration_s: float, config: BreakerConfig
) -> int | None:
    """How many requests had completed when the worker's breaker opened on its error
    rate (``None``: it never did). A failure completes in 0.1 s, a success in 1 s."""
    rng = random.Random(seed)
    breaker = Breaker("worker:w", config)
    requests, cpu, memory = RequestWindow(), GaugeWindow(), GaugeWindow()
    running: list[tuple[float, bool]] = []
    arrival, completed, t = 0.0, 0, 0.0
    while t < duration_s:
        while arrival <= t:
            ok = rng.random() >= error_rate
            running.append((arrival + (1.0 if ok else 0.1), ok))
            arrival += rng.expovariate(RATE)
        for done_at, ok in [r for r in running if r[0] <= t]:
            requests.record(done_at, 100.0, ok)
            completed += 1
        running = [r for r in running if r[0] > t]
        decision = breaker.evaluate(t, breaker_readings(config, t, requests, cpu, memory))
        if decision is not None and decision.new_state.circuit is Circuit.OPEN:
            assert decision.new_state.tripped == ("error_rate",)
            return completed
        t += TICK_S
    return None


def test_a_20_percent_worker_is_not_isolated_at_the_default_trip() -> None:
    config = BreakerConfig()
    assert config.error_rate.trip_above == 0.30
    tripped = [completions_until_tripped(0.2, seed, 600.0, config) for seed in range(100)]
    assert tripped == [None] * 100


def test_a_50_percent_worker_is_isolated_within_seconds() -> None:
    config = BreakerConfig()
    tripped = [completions_until_tripped(0.5, seed, 120.0, config) for seed in range(100)]
    assert None not in tripped
    counts = sorted(n for n in tripped if n is not None)
    assert statistics.median(counts) <= 30  # about 15 s at 2 requests a second
    assert counts[94] <= 100


def test_on_the_rate_alone_the_20_percent_worker_was_isolated() -> None:
    """What the bound is for: with z = 0 (the bound is the rate) the same runs trip."""
    config = dataclasses.replace(BreakerConfig(), error_rate_z=0.0)
    tripped = [completions_until_tripped(0.2, seed, 300.0, config) for seed in range(100)]
    assert sum(n is not None for n in tripped) >= 20


@pytest.mark.parametrize(
    ("hits", "n", "z", "expected"),
    [
        (0, 10, 2.0, 0.0),
        (5, 10, 0.0, 0.5),  # no confidence asked: the rate itself
        (3, 10, 2.5, 0.0825),
        (50, 100, 2.5, 0.3787),
        (500, 1000, 2.5, 0.4606),
    ],
)
def test_wilson_lower_bound(hits: int, n: int, z: float, expected: float) -> None:
    assert wilson_lower(hits, n, z) == pytest.approx(expected, abs=1e-4)
    assert wilson_lower(hits, n, z) <= hits / n
