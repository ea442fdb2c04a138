"""The simulated GPU: NVML-like readings that derive from the simulated engine's load.

Memory is what vLLM holds: the weights, the runtime reserve and the whole KV pool, all
allocated at start (so a healthy engine shows ``gpu_memory_utilization`` of the board),
plus any leak (:attr:`.sim_config.SimFaults.memory_leak_mb_per_s`); utilization is the
busy share of the last second of steps; temperature and power rise linearly with
utilization, and the over-temperature fault makes the temperature climb. Readings carry
``simulated=True``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from services.workers.engine.base import GpuReading
from services.workers.engine.profiles import RUNTIME_RESERVE_BYTES, kv_bytes_per_token
from services.workers.engine.sim_config import SimConfig

MIB: Final = 1024**2
UTILIZATION_WINDOW_S: Final = 1.0
"""NVML's utilization is the busy share of its last sample period (up to a second)."""
OVERHEAT_C_PER_S: Final = 1.0
OVERHEAT_MAX_C: Final = 97.0
THERMAL_SLOWDOWN_C: Final = 90.0
"""From here the simulated board reports ``sw_thermal_slowdown`` among its clock events."""


def simulated_gpu_reading(
    config: SimConfig, *, index: int, utilization: float, elapsed_s: float, memory_used: int
) -> GpuReading:
    """The reading at ``elapsed_s`` seconds of engine time, at ``utilization`` (0–1,
    :func:`busy_fraction`) with ``memory_used`` bytes held (:func:`memory_used_bytes`)."""
    gpu = config.gpu
    temperature = gpu.idle_temperature_c + utilization * (
        gpu.loaded_temperature_c - gpu.idle_temperature_c
    )
    if config.faults.over_temperature:
        temperature = min(OVERHEAT_MAX_C, temperature + OVERHEAT_C_PER_S * max(0.0, elapsed_s))
    reasons: tuple[str, ...] = ()
    if temperature >= THERMAL_SLOWDOWN_C:
        reasons = ("sw_thermal_slowdown",)
    elif utilization == 0.0:
        reasons = ("gpu_idle",)
    return GpuReading(
        index=index,
        name=gpu.display_name,
        utilization_pct=100.0 * utilization,
        memory_used_bytes=min(memory_used, gpu.memory_bytes),
        memory_total_bytes=gpu.memory_bytes,
        temperature_c=temperature,
        power_w=gpu.idle_power_w + utilization * (gpu.power_limit_w - gpu.idle_power_w),
        power_limit_w=gpu.power_limit_w,
        clock_event_reasons=reasons,
        simulated=True,
    )


def busy_fraction(intervals: Iterable[tuple[float, float]], now: float) -> float:
    """The busy share of the last :data:`UTILIZATION_WINDOW_S` of the ``(start, end)`` step
    intervals."""
    since = now - UTILIZATION_WINDOW_S
    busy = sum(max(0.0, min(end, now) - max(start, since)) for start, end in intervals)
    return min(1.0, busy / UTILIZATION_WINDOW_S)


def memory_used_bytes(config: SimConfig, kv_blocks: int, elapsed_s: float) -> int:
    """GPU memory held after ``elapsed_s`` seconds of engine time with a ``kv_blocks`` pool."""
    kv_pool = kv_blocks * config.block_size
    leak = config.faults.memory_leak_mb_per_s * MIB * max(0.0, elapsed_s)
    return int(
        config.model.weight_bytes
        + RUNTIME_RESERVE_BYTES
        + kv_pool * kv_bytes_per_token(config.model)
        + leak
    )
