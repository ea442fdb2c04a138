"""The worker's telemetry built from what its engine and GPU probe read: one place for
the worker service and for harnesses that play workers (the incident benchmark)."""

from __future__ import annotations

from schemas import EngineLimitsInfo, GpuStats
from services.workers.engine.base import EngineLimits, GpuReading


def limits_info(lim: EngineLimits) -> EngineLimitsInfo:
    """The engine's fixed limits as ``EngineStats`` carries them."""
    return EngineLimitsInfo(
        max_num_seqs=lim.max_num_seqs,
        max_num_batched_tokens=lim.max_num_batched_tokens,
        block_size=lim.block_size,
        kv_capacity_tokens=lim.kv_capacity_tokens,
        gpu_memory_utilization=lim.gpu_memory_utilization,
        max_model_len=lim.max_model_len,
    )


def gpu_stats(g: GpuReading, worker_id: str, pool: str, at: float) -> GpuStats:
    """One GPU reading on the wire (within the schema's bounds: NVML may report a
    utilization a hair above 100 %, and names or reason lists longer than it keeps)."""
    return GpuStats(
        worker_id=worker_id,
        pool=pool,
        gpu_index=g.index,
        name=g.name[:512],
        utilization_pct=None if g.utilization_pct is None else min(100.0, g.utilization_pct),
        memory_utilization_pct=None
        if g.memory_utilization_pct is None
        else min(100.0, g.memory_utilization_pct),
        memory_used_bytes=g.memory_used_bytes,
        memory_total_bytes=g.memory_total_bytes,
        process_memory_bytes=g.process_memory_bytes,
        temperature_c=g.temperature_c,
        power_w=g.power_w,
        power_limit_w=g.power_limit_w,
        pcie_tx_kbps=g.pcie_tx_kbps,
        pcie_rx_kbps=g.pcie_rx_kbps,
        ecc_corrected=g.ecc_corrected,
        ecc_uncorrected=g.ecc_uncorrected,
        clock_event_reasons=g.clock_event_reasons[:32],
        simulated=g.simulated,
        at=at,
    )
