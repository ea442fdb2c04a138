"""The records a worker sends — heartbeats, engine stats, GPU stats — built with every
field the schemas require set to a plausible value, for the tests and the benchmarks.
Each caller names only what its case is about (``running=4``, ``temperature_c=90``);
its own module keeps the defaults its cases share in a thin wrapper."""

from __future__ import annotations

from typing import Any

from schemas import EngineLimitsInfo, EngineStats, GpuStats, WorkerHeartbeat


def heartbeat(worker: str, at: float, pool: str = "main", **fields: Any) -> WorkerHeartbeat:
    """A serving simulated worker's heartbeat, started 100 s before ``at``."""
    base: dict[str, Any] = {
        "worker_id": worker,
        "pool": pool,
        "engine": "sim",
        "status": "serving",
        "in_flight": 0,
        "batch_limit": 32,
        "host_cpu_pct": 20.0,
        "host_memory_pct": 30.0,
        "started_at": at - 100,
        "at": at,
    }
    return WorkerHeartbeat(**(base | fields))


def engine_limits(**fields: Any) -> EngineLimitsInfo:
    base: dict[str, Any] = {
        "max_num_seqs": 64,
        "max_num_batched_tokens": 8192,
        "block_size": 16,
        "kv_capacity_tokens": 100_000,
    }
    return EngineLimitsInfo(**(base | fields))


def engine_stats(
    worker: str,
    at: float,
    pool: str = "main",
    *,
    limits: EngineLimitsInfo | None = None,
    **fields: Any,
) -> EngineStats:
    """An idle simulated engine's stats (``engine_limits()`` unless ``limits``)."""
    base: dict[str, Any] = {
        "worker_id": worker,
        "pool": pool,
        "engine": "sim",
        "running": 0,
        "waiting": 0,
        "preempted_total": 0,
        "kv_cache_usage": 0.0,
        "in_flight": 0,
        "batch_limit": 32,
        "limits": limits or engine_limits(),
        "at": at,
    }
    return EngineStats(**(base | fields))


def gpu_stats(worker: str, at: float, pool: str = "main", **fields: Any) -> GpuStats:
    """GPU 0 of a simulated 80 GB card, at 60 °C and 10 % of its memory."""
    base: dict[str, Any] = {
        "worker_id": worker,
        "pool": pool,
        "gpu_index": 0,
        "name": "sim-gpu",
        "utilization_pct": 75.0,
        "memory_used_bytes": 8 * 10**9,
        "memory_total_bytes": 8 * 10**10,
        "temperature_c": 60.0,
        "power_w": 300.0,
        "power_limit_w": 700.0,
        "simulated": True,
        "at": at,
    }
    return GpuStats(**(base | fields))
