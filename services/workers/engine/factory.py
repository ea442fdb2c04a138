"""Build the engine a worker's settings name."""

from __future__ import annotations

from services.workers.engine.base import Engine, EngineLimits
from services.workers.engine.openai_http import OpenAIHttpConfig, OpenAIHttpEngine
from services.workers.engine.profiles import GPUS, MODELS
from services.workers.engine.sim import SimulatedEngine
from services.workers.engine.sim_config import SimConfig, SimFaults
from services.workers.engine.vllm_engine import VllmEngine, VllmEngineConfig
from services.workers.settings import WorkerSettings


def sim_config(s: WorkerSettings) -> SimConfig:
    if s.sim_model not in MODELS or s.sim_gpu not in GPUS:
        raise ValueError(
            f"unknown simulator profile {s.sim_model!r} on {s.sim_gpu!r}: "
            f"models {sorted(MODELS)}, GPUs {sorted(GPUS)}"
        )
    return SimConfig(
        model=MODELS[s.sim_model],
        gpu=GPUS[s.sim_gpu],
        max_num_seqs=s.engine_max_num_seqs,
        max_num_batched_tokens=s.engine_max_num_batched_tokens,
        block_size=s.engine_block_size,
        gpu_memory_utilization=s.engine_gpu_memory_utilization,
        max_model_len=s.engine_max_model_len,
        scheduling_policy=s.engine_scheduling_policy,
        step_time_scale=s.sim_time_scale,
        faults=SimFaults(
            error_rate=s.sim_error_rate,
            slowdown=s.sim_slowdown,
            hang_after_s=s.sim_hang_after_s,
            crash_after_s=s.sim_crash_after_s,
            over_temperature=s.sim_over_temperature,
            memory_leak_mb_per_s=s.sim_memory_leak_mb_per_s,
            divergence=s.sim_divergence,
        ),
    )


def build_engine(s: WorkerSettings) -> Engine:
    if s.engine == "sim":
        return SimulatedEngine(sim_config(s), seed=s.sim_seed)
    if s.engine == "vllm":
        if not s.vllm_model:
            raise ValueError("SEAWALL_VLLM_MODEL must name the model to serve")
        return VllmEngine(
            VllmEngineConfig(
                model=s.vllm_model,
                max_model_len=s.engine_max_model_len,
                max_num_seqs=s.engine_max_num_seqs,
                max_num_batched_tokens=s.engine_max_num_batched_tokens,
                block_size=s.engine_block_size,
                gpu_memory_utilization=s.engine_gpu_memory_utilization,
                scheduling_policy=s.engine_scheduling_policy,
            )
        )
    return OpenAIHttpEngine(
        OpenAIHttpConfig(
            base_url=s.openai_base_url,
            model=s.openai_model,
            limits=EngineLimits(
                max_num_seqs=s.engine_max_num_seqs,
                max_num_batched_tokens=s.engine_max_num_batched_tokens,
                block_size=s.engine_block_size,
                gpu_memory_utilization=s.engine_gpu_memory_utilization,
                kv_capacity_tokens=0,
                max_model_len=s.engine_max_model_len,
            ),
        )
    )
