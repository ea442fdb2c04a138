"""The simulated scheduler: vLLM V1's batching rules, KV limits, determinism and faults."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.workers.engine.base import EngineError
from services.workers.engine.profiles import (
    GPUS,
    RUNTIME_RESERVE_BYTES,
    GpuProfile,
    ModelProfile,
    kv_bytes_per_token,
)
from services.workers.engine.sim_config import SimConfig, SimFaults
from services.workers.engine.sim_core import SimCore, StepResult
from services.workers.engine.sim_open_loop import run_open_loop, sharegpt_like_arrivals

pytestmark = pytest.mark.unit

TINY_MODEL = ModelProfile(
    "tiny", num_layers=1, num_kv_heads=1, head_dim=8, dtype_bytes=2, weight_bytes=0,
    max_model_len=1024,
)  # fmt: skip


def tiny_config(blocks: int, **kwargs: object) -> SimConfig:
    """A GPU whose KV cache holds exactly ``blocks`` blocks of 16 tokens (64-token requests
    unless ``max_model_len`` says otherwise)."""
    gpu = GpuProfile(
        name="tiny-gpu",
        display_name="Tiny GPU",
        memory_bytes=RUNTIME_RESERVE_BYTES + blocks * 16 * kv_bytes_per_token(TINY_MODEL),
        step=GPUS["a100-80g"].step,
        idle_power_w=50.0,
        power_limit_w=300.0,
        idle_temperature_c=30.0,
        loaded_temperature_c=70.0,
    )
    # Llama-2-7B's step times: scaled to this weightless model they would be c0 alone.
    settings: dict[str, object] = {"max_model_len": 64, "step": gpu.step, **kwargs}
    return SimConfig(model=TINY_MODEL, gpu=gpu, gpu_memory_utilization=1.0, **settings)  # type: ignore[arg-type]


def drive(core: SimCore, steps: int, now: float = 0.0) -> tuple[list[StepResult], float]:
    results = []
    for _ in range(steps):
        result = core.step(now)
        results.append(result)
        now += result.duration_ms / 1000.0
    return results, now


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# -- scheduling ---------------------------------------------------------------------------


def test_a_request_prefills_then_decodes_one_token_per_step() -> None:
    core = SimCore(SimConfig())
    core.add("a", 100, 3, now=0.0)
    results, _ = drive(core, 4)
    assert [r.scheduled_tokens for r in results] == [100, 1, 1, 0]
    assert results[0].first_token == ("a",)
    assert [dict(r.new_tokens) for r in results[:3]] == [{"a": 1}] * 3
    assert results[2].finished == {"a": "length"}
    assert results[3].idle
    stats = core.stats(1.0)
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (100, 3)


def test_long_prompts_are_chunked_to_the_token_budget_after_the_decodes() -> None:
    core = SimCore(SimConfig(max_num_batched_tokens=512))
    core.add("old", 10, 100, now=0.0)
    drive(core, 1)
    core.add("long", 1200, 5, now=0.0)
    results, _ = drive(core, 3)
    # The decode of "old" goes first; "long" takes the rest of each step's budget.
    assert [r.scheduled_tokens for r in results] == [512, 512, 1 + 178]
    assert [r.first_token for r in results] == [(), (), ("long",)]


def test_max_num_seqs_caps_the_running_set() -> None:
    core = SimCore(SimConfig(max_num_seqs=2))
    for i in range(5):
        core.add(f"r{i}", 10, 50, now=0.0)
    results, _ = drive(core, 3)
    assert all(r.running == 2 for r in results)
    assert core.stats(1.0).waiting == 3


def test_preemption_takes_the_newest_and_requeues_it_at_the_front() -> None:
    core = SimCore(tiny_config(blocks=6, max_num_seqs=4, max_num_batched_tokens=64))
    for request_id in "ABC":
        core.add(request_id, 16, 40, now=0.0)
    preempted: list[tuple[int, str]] = []
    tokens: dict[str, list[int]] = {"A": [], "B": [], "C": [], "D": []}
    results: list[StepResult] = []
    now = 0.0
    for index in range(80):
        if index == 18:
            core.add("D", 16, 4, now=now)
        result = core.step(now)
        now += result.duration_ms / 1000.0
        results.append(result)
        preempted.extend((index, request_id) for request_id in result.preempted)
        for request_id in result.new_tokens:
            tokens[request_id].append(index)
    # Step 17: all three need a third block, the pool has none left: C, the newest, goes.
    # Step 33: A and B need a fourth: B, the newer of the two running, goes (to the front,
    # ahead of C). Step 41: B decodes, C's resumed prefill needs blocks: C is the newest.
    assert preempted == [(17, "C"), (33, "B"), (41, "C")]
    assert tokens["A"][-1] == 39  # A runs to the end undisturbed
    assert next(t for t in tokens["B"] if t > 33) == 40  # B resumes first when A frees
    # D, queued behind the preempted C, starts only with C's recomputation, which is a
    # prefill of its prompt and the 17 tokens it had made: 16 + 17, plus D's prompt.
    assert tokens["D"][0] == 47
    assert next(t for t in tokens["C"] if t > 41) == 47
    assert results[47].scheduled_tokens == 16 + 17 + 16
    assert results[47].first_token == ("D",)
    assert [len(tokens[r]) for r in "ABCD"] == [40, 40, 40, 4]
    assert core.preempted_total == 3


def test_priority_policy_runs_the_lowest_priority_value_first() -> None:
    core = SimCore(SimConfig(max_num_seqs=1, scheduling_policy="priority"))
    core.add("late-but-urgent", 10, 1, now=0.0, priority=0, arrival=1.0)
    core.add("early", 10, 1, now=0.0, priority=5, arrival=0.0)
    results, _ = drive(core, 2)
    assert [r.first_token for r in results] == [("late-but-urgent",), ("early",)]


def test_priority_policy_preempts_the_lowest_priority_even_if_already_scheduled() -> None:
    config = tiny_config(blocks=3, max_model_len=48, scheduling_policy="priority")
    core = SimCore(config)
    core.add("low", 16, 20, now=0.0, priority=5)
    drive(core, 1)
    core.add("high", 16, 20, now=0.0, priority=0)
    results, _ = drive(core, 2)
    # Step 2: "low" (first in the running list) is scheduled, then "high" needs a second
    # block and none is free: "low" gives its token back and is preempted instead.
    assert results[1].preempted == ("low",)
    assert results[1].new_tokens == {"high": 1}
    assert results[1].scheduled_tokens == 1
    assert core.stats(1.0).waiting == 1


def test_fcfs_ignores_priority() -> None:
    core = SimCore(SimConfig(max_num_seqs=1))
    core.add("first", 10, 1, now=0.0, priority=5)
    core.add("second", 10, 1, now=0.0, priority=0)
    results, _ = drive(core, 2)
    assert [r.first_token for r in results] == [("first",), ("second",)]


def test_abort_frees_the_request_wherever_it_is() -> None:
    core = SimCore(SimConfig(max_num_seqs=1))
    core.add("running", 100, 50, now=0.0)
    core.add("waiting", 100, 50, now=0.0)
    drive(core, 2)
    assert core.stats(1.0).kv_blocks_used > 0
    assert core.abort("waiting")
    assert core.abort("running")
    assert not core.abort("running")
    stats = core.stats(1.0)
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert core.step(1.0).idle


def test_requests_vllm_would_refuse_are_refused() -> None:
    core = SimCore(SimConfig())
    core.add("a", 10, 10, now=0.0)
    with pytest.raises(ValueError, match="already"):
        core.add("a", 10, 10, now=0.0)
    with pytest.raises(ValueError, match="max_model_len"):
        core.add("too-long", 4096, 10, now=0.0)
    with pytest.raises(ValueError, match="max_model_len"):
        core.add("empty", 0, 10, now=0.0)


def test_generation_stops_at_max_model_len() -> None:
    core = SimCore(SimConfig())
    core.add("a", 4090, 100, now=0.0)
    results, _ = drive(core, 10)
    assert sum(sum(r.new_tokens.values()) for r in results) == 6
    assert any(r.finished == {"a": "length"} for r in results)


def test_settings_vllm_would_not_start_with_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SimConfig(max_num_seqs=256, max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="KV cache"):
        tiny_config(blocks=3)  # 48 tokens cannot hold one 64-token request


def test_eos_probability_ends_requests_early_with_stop() -> None:
    core = SimCore(SimConfig(eos_probability=0.05), seed=3)
    records = run_open_loop(core, [(0.0, 50, 400)] * 200 + [(0.0, 50, 30)] * 200)
    long, short = records[:200], records[200:]
    assert {r.finish_reason for r in long} == {"stop"}
    mean = sum(r.output_tokens for r in long) / len(long)
    assert 15 < mean < 25  # geometric, mean 1/p = 20
    # Under 30 tokens, P(no EOS) = 0.95^29 ≈ 23%: those end at max_tokens.
    capped = [r for r in short if r.finish_reason == "length"]
    assert 0.15 < len(capped) / len(short) < 0.32
    assert all(r.output_tokens == 30 for r in capped)
    assert all(r.output_tokens < 30 for r in short if r.finish_reason == "stop")


@settings(max_examples=100, deadline=None)
# A step that only preempted once read as idle, and the engine waited for new work
# with requests still queued (found by this test).
@example(
    max_num_seqs=3,
    extra_budget=3,
    blocks=4,
    policy="priority",
    arrivals=[(0.875, 15, 4, 0), (0.90625, 1, 3, 0), (0.765625, 1, 17, 1)],
)
@given(
    max_num_seqs=st.integers(1, 8),
    extra_budget=st.integers(0, 120),
    blocks=st.integers(4, 24),
    policy=st.sampled_from(["fcfs", "priority"]),
    arrivals=st.lists(
        st.tuples(st.floats(0.0, 1.0), st.integers(1, 63), st.integers(1, 30), st.integers(0, 3)),
        min_size=1,
        max_size=30,
    ),
)
def test_limits_are_never_exceeded_and_every_request_finishes(
    max_num_seqs: int,
    extra_budget: int,
    blocks: int,
    policy: str,
    arrivals: list[tuple[float, int, int, int]],
) -> None:
    config = tiny_config(
        blocks=blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + extra_budget,
        scheduling_policy=policy,
    )
    core = SimCore(config)
    arrivals = sorted(arrivals)
    now, nxt, generated = 0.0, 0, 0
    for _ in range(20_000):
        while nxt < len(arrivals) and arrivals[nxt][0] <= now:
            _, prompt, max_tokens, priority = arrivals[nxt]
            prompt = min(prompt, config.model_len - 1)
            core.add(f"r{nxt}", prompt, max_tokens, now=now, priority=priority)
            nxt += 1
        result = core.step(now)
        stats = core.stats(now)
        assert result.running <= max_num_seqs
        assert stats.running <= max_num_seqs
        assert result.scheduled_tokens <= config.max_num_batched_tokens
        assert 0 <= stats.kv_blocks_used <= blocks
        generated += sum(result.new_tokens.values())
        if result.idle:
            if nxt == len(arrivals):
                break
            now = arrivals[nxt][0]
        now += result.duration_ms / 1000.0
    assert nxt == len(arrivals)
    stats = core.stats(now)
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    expected = sum(
        min(max_tokens, config.model_len - min(prompt, config.model_len - 1))
        for _, prompt, max_tokens, _ in arrivals
    )
    assert generated == expected == stats.generation_tokens_total


# -- determinism --------------------------------------------------------------------------


def test_identical_runs_under_the_same_seed_give_identical_records() -> None:
    config = SimConfig(max_num_seqs=32, eos_probability=0.01, faults=SimFaults(error_rate=0.1))
    arrivals = sharegpt_like_arrivals(20.0, 10.0, seed=7)
    first = run_open_loop(SimCore(config, seed=11), arrivals)
    second = run_open_loop(SimCore(config, seed=11), arrivals)
    other_seed = run_open_loop(SimCore(config, seed=12), arrivals)
    assert first == second
    assert first != other_seed
    assert sharegpt_like_arrivals(20.0, 10.0, seed=7) == arrivals


def test_sharegpt_like_arrivals_have_the_calibration_means() -> None:
    arrivals = sharegpt_like_arrivals(50.0, 100.0, seed=1)
    assert len(arrivals) == pytest.approx(5000, rel=0.05)
    prompts = [p for _, p, _ in arrivals]
    outputs = [o for _, _, o in arrivals]
    assert sum(prompts) / len(prompts) == pytest.approx(230, rel=0.05)
    assert sum(outputs) / len(outputs) == pytest.approx(200, rel=0.05)
    assert min(prompts + outputs) >= 4
    assert max(prompts + outputs) <= 1024


# -- overload -----------------------------------------------------------------------------


def test_past_kv_capacity_requests_are_preempted_and_p99_latency_climbs() -> None:
    # 1,120 tokens of KV on an otherwise A100-like board: 4 requests of 260 tokens fit.
    config = tiny_config(blocks=70, max_model_len=512)

    def run(rate: float) -> tuple[float, int]:
        interval = 1.0 / rate
        arrivals = [(i * interval, 60, 200) for i in range(int(30 * rate))]
        core = SimCore(config)
        records = run_open_loop(core, arrivals)
        return p99([r.latency or 0.0 for r in records]), core.preempted_total

    # One request takes ~2.3 s; at 1 req/s about 2-3 run at once, at 4 req/s about 10.
    below_p99, below_preempted = run(1.0)
    above_p99, above_preempted = run(4.0)
    assert below_preempted == 0
    assert above_preempted > 0
    assert above_p99 > 4 * below_p99


# -- faults -------------------------------------------------------------------------------


def test_error_rate_fails_that_share_of_requests() -> None:
    core = SimCore(SimConfig(faults=SimFaults(error_rate=0.3)), seed=5)
    records = run_open_loop(core, [(0.0, 20, 20)] * 400)
    failed = [r for r in records if r.finish_reason == "error"]
    assert 0.22 < len(failed) / len(records) < 0.38
    assert all(r.output_tokens < 20 for r in failed)
    assert all(r.finish_reason == "length" for r in records if r not in failed)


def test_slowdown_multiplies_step_time() -> None:
    def first_step(config: SimConfig) -> float:
        core = SimCore(config)
        core.add("a", 100, 5, now=0.0)
        return core.step(0.0).duration_ms

    normal = first_step(SimConfig())
    assert first_step(SimConfig(faults=SimFaults(slowdown=3.0))) == pytest.approx(3 * normal)
    assert first_step(SimConfig(step_time_scale=1.5)) == pytest.approx(1.5 * normal)


def test_hang_stops_all_progress() -> None:
    core = SimCore(SimConfig(faults=SimFaults(hang_after_s=1.0)), start_time=100.0)
    records = run_open_loop(core, [(100.0 + 0.5 * i, 50, 500) for i in range(4)])
    assert all(r.finish_time is None for r in records)
    assert all(r.first_token_time is not None for r in records[:2])
    assert all(r.first_token_time is None for r in records[2:])
    assert max(r.first_token_time or 0.0 for r in records) < 101.0
    stats = core.stats(200.0)
    assert (stats.running, stats.waiting) == (2, 2)  # stuck, not gone
    assert core.step(200.0).idle


def test_crash_makes_every_call_fail() -> None:
    core = SimCore(SimConfig(faults=SimFaults(crash_after_s=2.0)), start_time=10.0)
    core.add("a", 10, 1000, now=10.0)
    drive(core, 3, now=10.0)
    with pytest.raises(EngineError, match="crash"):
        core.step(12.0)
    with pytest.raises(EngineError):
        core.abort("a")
    with pytest.raises(EngineError):
        core.stats(10.0)  # latched, whatever the time
    with pytest.raises(EngineError):
        core.add("b", 10, 10, now=10.0)
    with pytest.raises(EngineError):
        core.gpu_reading(10.0)


def test_over_temperature_climbs_past_90_and_reports_thermal_slowdown() -> None:
    normal = SimCore(SimConfig())
    hot = SimCore(SimConfig(faults=SimFaults(over_temperature=True)))
    for core in (normal, hot):
        core.add("a", 100, 1000, now=0.0)
    assert hot.gpu_reading(0.0).temperature_c < 90.0
    assert normal.gpu_reading(120.0).temperature_c < 90.0
    reading = hot.gpu_reading(120.0)
    assert reading.temperature_c > 90.0
    assert "sw_thermal_slowdown" in reading.clock_event_reasons


def test_memory_leak_grows_memory_then_crashes_out_of_memory() -> None:
    core = SimCore(SimConfig(faults=SimFaults(memory_leak_mb_per_s=1024.0)))
    start = core.gpu_reading(0.0)
    # Like vLLM, the engine holds its whole reservation from the start.
    assert start.memory_used_bytes / start.memory_total_bytes == pytest.approx(0.9, abs=0.005)
    assert core.gpu_reading(5.0).memory_used_bytes - start.memory_used_bytes == 5 * 1024**3
    # 80 GiB less the 72 GiB reserved leave ~8 GiB to leak at 1 GiB/s.
    assert core.gpu_reading(7.0).memory_used_bytes < 80 * 1024**3
    with pytest.raises(EngineError, match="out of memory"):
        core.gpu_reading(9.0)


# -- simulated GPU ------------------------------------------------------------------------


def test_gpu_reading_follows_the_load() -> None:
    core = SimCore(SimConfig())
    gpu = SimConfig().gpu
    idle = core.gpu_reading(0.0)
    assert idle.simulated
    assert idle.utilization_pct == 0.0
    assert idle.power_w == gpu.idle_power_w
    assert idle.clock_event_reasons == ("gpu_idle",)
    for i in range(64):
        core.add(f"r{i}", 500, 1000, now=0.0)
    _, now = drive(core, 100)
    busy = core.gpu_reading(now)
    assert busy.utilization_pct == pytest.approx(100.0)
    assert gpu.idle_power_w < busy.power_w <= gpu.power_limit_w
    assert busy.temperature_c > idle.temperature_c
    assert core.stats(now).kv_blocks_used > 0
    # The KV pool was reserved at start, as vLLM does: load does not move memory.
    assert busy.memory_used_bytes == idle.memory_used_bytes
    # A second later, with nothing run since, the board is idle again.
    assert core.gpu_reading(now + 1.0).utilization_pct == 0.0
