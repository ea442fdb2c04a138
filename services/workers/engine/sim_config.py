"""The simulated engine's configuration: vLLM's engine arguments, and the faults to inject.

Defaults are vLLM's on A100 (``engine/arg_utils.py``): ``max_num_seqs`` 256,
``max_num_batched_tokens`` 2048, ``block_size`` 16. KV capacity comes from
:mod:`.profiles` (7,449 blocks for Llama-2-7B on an A100 80GB at 0.9, FlightLLM's log),
step-time coefficients from :func:`.profiles.step_coefficients` (:mod:`.sim_timing`).

Faults (:class:`SimFaults`) are injected by configuration, for chaos tests: failing
requests, slow steps, a hang, a crash, over-temperature and a memory leak that ends in
an out-of-memory crash. :class:`.sim_core.SimCore` and :mod:`.sim_gpu` act on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.workers.engine.base import EngineLimits
from services.workers.engine.profiles import (
    GPUS,
    MODELS,
    GpuProfile,
    ModelProfile,
    StepCoefficients,
    kv_capacity_blocks,
    step_coefficients,
)

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True, slots=True)
class SimFaults:
    """Faults to inject; times are engine time, seconds since the core's ``start_time``."""

    error_rate: float = 0.0
    """Share of requests that fail (finish reason ``error``) at a random point of their output."""
    slowdown: float = 1.0
    """Step-time multiplier."""
    hang_after_s: float | None = None
    """From then on no step makes progress (requests stay put, nothing is generated)."""
    crash_after_s: float | None = None
    """From then on every call raises :class:`EngineError`."""
    over_temperature: bool = False
    """The GPU temperature climbs 1 °C/s past 90 °C, to 97 °C."""
    memory_leak_mb_per_s: float = 0.0
    """GPU memory in use grows by this many MiB per second; at full memory the engine
    crashes with an out-of-memory error, as a CUDA allocation would fail."""
    divergence: float = 0.0
    """Share of requests whose text departs from what their prompt gives everywhere
    else, from a random token on — as a model whose numerics changed would answer: what
    the output-consistency check must catch (:mod:`.sim` makes the words)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0 or not 0.0 <= self.divergence <= 1.0:
            raise ValueError("error_rate and divergence must be within [0, 1]")
        if self.slowdown <= 0 or self.memory_leak_mb_per_s < 0:
            raise ValueError("slowdown must be positive and memory_leak_mb_per_s not negative")


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: ModelProfile = MODELS["llama-2-7b"]
    gpu: GpuProfile = GPUS["a100-80g"]
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    """``None``: the model's."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    step: StepCoefficients | None = None
    """``None``: :func:`.profiles.step_coefficients` for the model and GPU."""
    step_time_scale: float = 1.0
    """Multiplies every step time (calibration knob, e.g. for a slower software stack)."""
    eos_probability: float = 0.0
    """Chance that each generated token ends the request (finish reason ``stop``)."""
    faults: SimFaults = field(default_factory=SimFaults)

    def __post_init__(self) -> None:
        # The checks vLLM makes when it starts (with chunked prefill on).
        if self.max_num_seqs < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs and block_size must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be within (0, 1]")
        if self.step_time_scale <= 0 or not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError("step_time_scale must be positive, eos_probability within [0, 1]")
        if self.kv_blocks * self.block_size < self.model_len:
            raise ValueError(
                f"max_model_len {self.model_len} exceeds the KV cache "
                f"({self.kv_blocks * self.block_size} tokens) on {self.gpu.name}"
            )

    @property
    def model_len(self) -> int:
        return self.max_model_len or self.model.max_model_len

    @property
    def kv_blocks(self) -> int:
        return kv_capacity_blocks(
            self.model, self.gpu, self.gpu_memory_utilization, self.block_size
        )

    @property
    def coefficients(self) -> StepCoefficients:
        return self.step or step_coefficients(self.model, self.gpu)

    def limits(self) -> EngineLimits:
        return EngineLimits(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_capacity_tokens=self.kv_blocks * self.block_size,
            max_model_len=self.model_len,
        )
