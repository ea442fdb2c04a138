"""The simulator against CALIBRATION.md's figures, on virtual time."""

from __future__ import annotations

import pytest

from services.workers.engine.sim_config import SimConfig
from services.workers.engine.sim_core import SimCore
from services.workers.engine.sim_open_loop import (
    INCIDENT_BURST_RATE,
    INCIDENT_SEED,
    INCIDENT_STEADY_RATE,
    INCIDENT_WINDOW_S,
    run_open_loop,
    sharegpt_like_arrivals,
)

pytestmark = pytest.mark.unit


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@pytest.mark.parametrize(("batch", "predicted_ms"), [(1, 10.9), (8, 12.1), (64, 21.9), (128, 34.3)])
def test_decode_step_at_512_token_contexts(batch: int, predicted_ms: float) -> None:
    # A budget that prefills the whole batch at once, so the next step is pure decode.
    core = SimCore(SimConfig(max_num_seqs=batch, max_num_batched_tokens=batch * 511))
    for i in range(batch):
        core.add(f"r{i}", 511, 10, now=0.0)
    prefill = core.step(0.0)
    assert len(prefill.first_token) == batch
    decode = core.step(1.0)  # every sequence now attends to 511 + 1 tokens
    assert decode.scheduled_tokens == batch
    assert decode.duration_ms == pytest.approx(predicted_ms, rel=0.03)


def test_batch_1_decode_is_close_to_flightllm_measurement() -> None:
    records = run_open_loop(SimCore(SimConfig()), [(0.0, 128, 101)])
    (record,) = records
    assert record.latency is not None
    assert record.ttft is not None
    per_token_ms = (record.latency - record.ttft) / 100 * 1000
    assert 10.5 < per_token_ms < 11.5  # measured 11.2–11.5 ms at batch 1


@pytest.mark.parametrize(("prompt", "predicted_ms"), [(512, 37.0), (2048, 142.0), (4095, 295.0)])
def test_time_to_first_token_at_batch_1(prompt: int, predicted_ms: float) -> None:
    (record,) = run_open_loop(SimCore(SimConfig()), [(0.0, prompt, 1)])
    assert record.ttft is not None
    assert record.ttft * 1000 == pytest.approx(predicted_ms, rel=0.03)


def _tokens_per_s(max_num_seqs: int, requests: int, prompt: int, output: int) -> tuple[float, int]:
    core = SimCore(SimConfig(max_num_seqs=max_num_seqs))
    records = run_open_loop(core, [(0.0, prompt, output)] * requests)
    makespan = max(r.finish_time or 0.0 for r in records)
    return sum(r.output_tokens for r in records) / makespan, core.preempted_total


def test_throughput_rises_with_batch_size() -> None:
    rates = [_tokens_per_s(b, b, 200, 200)[0] for b in (1, 4, 16, 64, 256)]
    assert rates == sorted(rates)
    assert rates[-1] > 30 * rates[0]
    assert rates[0] == pytest.approx(1000 / 11.0, rel=0.05)


def test_past_the_kv_capacity_a_larger_batch_adds_nothing_but_preemptions() -> None:
    # 2,000-token requests: 119,184 KV tokens hold about 59 of them at full length.
    small, small_preempted = _tokens_per_s(16, 128, 1000, 1000)
    fit, _ = _tokens_per_s(48, 128, 1000, 1000)
    large, large_preempted = _tokens_per_s(256, 128, 1000, 1000)
    assert small < fit
    assert small_preempted == 0
    assert large_preempted > 0
    assert large < 1.1 * fit


def test_saturation_with_sharegpt_like_lengths() -> None:
    # CALIBRATION: the step model saturates near 18–20 req/s with these lengths (fixed),
    # against the 13.2 online / 15.6 offline req/s vLLM published for its older engine.
    arrivals = [(0.0, 230, 200)] * 1000
    records = run_open_loop(SimCore(SimConfig()), arrivals)
    makespan = max(r.finish_time or 0.0 for r in records)
    assert 18.0 < len(records) / makespan < 20.0


def test_the_seed_incident_load_shape() -> None:
    def ttfts(rate: float) -> list[float]:
        arrivals = sharegpt_like_arrivals(rate, INCIDENT_WINDOW_S, seed=INCIDENT_SEED)
        records = run_open_loop(SimCore(SimConfig()), arrivals)
        return [r.ttft for r in records if r.ttft is not None]

    steady, burst = ttfts(INCIDENT_STEADY_RATE), ttfts(INCIDENT_BURST_RATE)
    assert p99(steady) == pytest.approx(1.2, abs=0.3)
    assert p99(burst) == pytest.approx(3.8, rel=0.2)
    assert p99(burst) >= 2.5 * p99(steady)
    # A tail, not a shift: the median request still gets its first token at once.
    assert sorted(steady)[len(steady) // 2] < 0.2
