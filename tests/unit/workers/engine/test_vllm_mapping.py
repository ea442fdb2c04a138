"""The vLLM adapter's pure parts: none of these needs vLLM (the engine itself is tested in
test_vllm_engine.py, on a GPU host with vLLM installed)."""

from types import SimpleNamespace

import pytest

from services.workers.engine.base import EngineError, EngineRequest
from services.workers.engine.vllm_engine import (
    SchedulerStatsSink,
    VllmEngine,
    VllmEngineConfig,
    engine_args_kwargs,
    map_finish_reason,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("vllm_reason", "ours"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("abort", "abort"),
        ("error", "error"),
        ("repetition", "stop"),
        ("something-new", "error"),
        (None, "error"),
    ],
)
def test_map_finish_reason(vllm_reason: str | None, ours: str) -> None:
    assert map_finish_reason(vllm_reason) == ours


def test_engine_args_carry_the_settings() -> None:
    config = VllmEngineConfig(
        model="meta-llama/Llama-2-7b-hf",
        max_model_len=4096,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        block_size=32,
        gpu_memory_utilization=0.85,
        tensor_parallel_size=2,
        extra_args={"dtype": "float16", "enforce_eager": True},
    )
    assert engine_args_kwargs(config) == {
        "model": "meta-llama/Llama-2-7b-hf",
        "max_model_len": 4096,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 8192,
        "block_size": 32,
        "gpu_memory_utilization": 0.85,
        "tensor_parallel_size": 2,
        "scheduling_policy": "priority",
        "disable_log_stats": False,
        "dtype": "float16",
        "enforce_eager": True,
    }


def test_extra_args_may_not_shadow_typed_settings() -> None:
    config = VllmEngineConfig(model="m", max_model_len=2048, extra_args={"max_num_seqs": 512})
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_args_kwargs(config)


# Shaped like vllm/v1/metrics/stats.py's SchedulerStats and IterationStats.
def _scheduler_stats(running: int, waiting: int, usage: float) -> SimpleNamespace:
    return SimpleNamespace(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage)


def _iteration_stats(preempted: int, prompt: int, generation: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_preempted_reqs=preempted, num_prompt_tokens=prompt, num_generation_tokens=generation
    )


def test_sink_keeps_latest_gauges_and_accumulates_counters() -> None:
    sink = SchedulerStatsSink()
    sink.record(_scheduler_stats(3, 5, 0.4), _iteration_stats(1, 100, 3))
    sink.record(_scheduler_stats(8, 0, 0.9), _iteration_stats(2, 0, 8))
    sink.record(None, _iteration_stats(0, 50, 1))
    assert (sink.running, sink.waiting, sink.kv_cache_usage) == (8, 0, 0.9)
    assert sink.preempted_total == 3
    assert sink.prompt_tokens_total == 150
    assert sink.generation_tokens_total == 12


def test_sink_reads_the_pre_0_10_kv_field() -> None:
    sink = SchedulerStatsSink()
    sink.record(SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, gpu_cache_usage=0.25), None)
    assert sink.kv_cache_usage == 0.25


def _engine(**overrides: object) -> VllmEngine:
    settings: dict[str, object] = {"model": "m", "max_model_len": 2048, "max_num_seqs": 32}
    settings.update(overrides)
    return VllmEngine(VllmEngineConfig(**settings))  # type: ignore[arg-type]


def test_limits_before_start_use_the_declared_capacity() -> None:
    limits = _engine(kv_capacity_tokens=100_000).limits
    assert (limits.max_num_seqs, limits.max_model_len, limits.kv_capacity_tokens) == (
        32,
        2048,
        100_000,
    )


def test_limits_before_start_fall_back_to_one_full_request() -> None:
    assert _engine().limits.kv_capacity_tokens == 2048


def test_snapshot_before_start_is_idle() -> None:
    snapshot = _engine().snapshot()
    assert (snapshot.running, snapshot.waiting, snapshot.kv_cache_usage) == (0, 0, 0.0)
    assert snapshot.limits.max_num_seqs == 32


async def test_generate_before_start_is_an_engine_error() -> None:
    request = EngineRequest(request_id="r1", prompt="hi", prompt_tokens=1, max_tokens=4)
    with pytest.raises(EngineError, match="not started"):
        await anext(_engine().generate(request))


async def test_abort_and_stop_before_start_do_nothing() -> None:
    engine = _engine()
    await engine.abort("r1")
    await engine.stop()
