"""Model and GPU profiles for the simulated engine, as data.

Figures come from ``CALIBRATION.md`` (in the shared design folder) and the sources it
cites; each constant below names where it comes from.

- KV bytes per token = 2 (K and V) × layers × KV heads × head dim × dtype bytes, as in
  vidur's ``vidur/config/model_config.py``: Llama-2-7B 512 KiB, Llama-2-13B 800 KiB,
  Llama-3-8B 128 KiB, CodeLlama-34B (8 grouped KV heads) 192 KiB. These correct the
  seeds' KV-cache table (see DESIGN, "Seed code to fix").
- KV capacity follows vLLM's memory profiling: of ``gpu_memory_utilization`` × GPU
  memory, the weights and the runtime's other usage (activation peak, CUDA context,
  non-torch allocations) are taken out and the rest is cut into blocks.
  :data:`RUNTIME_RESERVE_BYTES` stands for that other usage; it is calibrated so that
  Llama-2-7B on an A100 80GB at 0.9 gets FlightLLM's logged ``# GPU blocks: 7449``
  (119,184 tokens of 16-token blocks).
- Step-time coefficients (see :class:`StepCoefficients`) are CALIBRATION's fit for
  Llama-2-7B: the non-attention GPU time from vidur's A100 / H100 ``mlp.csv`` profiles,
  the per-context-token decode cost from DistServe's A100 profiles, the fixed per-step
  overhead and prefill-attention term chosen to match FlightLLM's batch-1 decode and
  TTFT measurements. Llama-3-8B on A100 has its own measured set; every other
  (model, GPU) pair scales the GPU's Llama-2-7B set by the model's size (see
  :func:`step_coefficients`), a first-order estimate: decode is bound by reading the
  weights and the KV cache, prefill by FLOPs, both roughly proportional to those sizes.

Power and temperature figures are typical board values (NVIDIA datasheets' power
limits; idle and loaded temperatures of air-cooled SXM boards), used only to shape the
simulated GPU readings; they are not calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

GIB: Final = 1024**3

RUNTIME_RESERVE_BYTES: Final = int(1.25 * GIB)
"""GPU memory vLLM's profiling finds in use besides the weights; see the module docstring.

It also absorbs the gap between the nominal 80 GiB used below and what CUDA reports as
usable on an 80 GB board (≈ 79.2 GiB), which is why it is larger than an activation
peak alone would be.
"""


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    weight_bytes: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """CALIBRATION's step-time model for one (model, GPU) pair.

    ``t_ms = c0 + sqrt(F² + (s·N)²) + k_kv·Σ decode contexts + k_pf·Σ c_j·(p_j + c_j/2)``,
    N the tokens computed in the step, c_j a prefill chunk and p_j the tokens of that
    request already computed. The hyperbola joins the weight-read floor F (small N) to
    the compute slope s (large N); ``c_j·(p_j + c_j/2)`` is the attention work of a
    chunk, whose every token attends to all tokens before it.
    """

    c0_ms: float
    F_ms: float
    s_ms_per_token: float
    k_kv_ms_per_token: float
    k_pf_ms: float


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    display_name: str
    """What NVML would call the board."""
    memory_bytes: int
    step: StepCoefficients
    """For the reference model (:data:`REFERENCE_MODEL`, Llama-2-7B fp16)."""
    idle_power_w: float
    power_limit_w: float
    idle_temperature_c: float
    loaded_temperature_c: float
    """Steady temperature at 100% utilization, well below the 90 °C danger line."""


def _model(
    name: str, layers: int, kv_heads: int, params: int, max_model_len: int, head_dim: int = 128
) -> ModelProfile:
    """An fp16 model, from its parameters."""
    return ModelProfile(
        name=name,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype_bytes=2,
        weight_bytes=params * 2,
        max_model_len=max_model_len,
    )


# Parameter counts from the models' Hugging Face safetensors indexes.
MODELS: Final = MappingProxyType(
    {
        m.name: m
        for m in (
            _model("llama-2-7b", 32, 32, 6_738_415_616, 4096),
            _model("llama-2-13b", 40, 40, 13_015_864_320, 4096),
            _model("llama-3-8b", 32, 8, 8_030_261_248, 8192),
            _model("codellama-34b", 48, 8, 33_743_970_304, 16384),
            # The small pool's model (degradation level 1 diverts non-VIP work to it).
            _model("llama-3.2-1b", 16, 8, 1_235_814_400, 8192, head_dim=64),
        )
    }
)

REFERENCE_MODEL: Final = "llama-2-7b"
"""The model every :attr:`GpuProfile.step` is fitted for."""

GPUS: Final = MappingProxyType(
    {
        g.name: g
        for g in (
            GpuProfile(
                name="a100-80g",
                display_name="NVIDIA A100-SXM4-80GB",
                memory_bytes=80 * GIB,
                step=StepCoefficients(
                    c0_ms=1.5,
                    F_ms=9.3,
                    s_ms_per_token=0.0655,
                    k_kv_ms_per_token=0.32e-3,
                    k_pf_ms=3e-6,
                ),
                idle_power_w=60.0,
                power_limit_w=400.0,
                idle_temperature_c=32.0,
                loaded_temperature_c=72.0,
            ),
            GpuProfile(
                name="h100-80g",
                display_name="NVIDIA H100 80GB HBM3",
                memory_bytes=80 * GIB,
                # CALIBRATION's H100 figures for F, s and k_kv; the CPU-side c0 is the
                # A100's, and k_pf shrinks with the compute slope s (0.0215 / 0.0655).
                step=StepCoefficients(
                    c0_ms=1.5,
                    F_ms=5.6,
                    s_ms_per_token=0.0215,
                    k_kv_ms_per_token=0.19e-3,
                    k_pf_ms=1e-6,
                ),
                idle_power_w=70.0,
                power_limit_w=700.0,
                idle_temperature_c=30.0,
                loaded_temperature_c=70.0,
            ),
        )
    }
)

MEASURED_STEP: Final = MappingProxyType(
    {
        # CALIBRATION: "For Llama-3-8B on A100: F = 10.1, s = 0.067, k_kv = 0.08 µs";
        # its attention is as wide as Llama-2-7B's, so k_pf is unchanged.
        ("llama-3-8b", "a100-80g"): StepCoefficients(
            c0_ms=1.5, F_ms=10.1, s_ms_per_token=0.067, k_kv_ms_per_token=0.08e-3, k_pf_ms=3e-6
        ),
    }
)
"""Coefficients measured for a (model, GPU) pair, preferred to scaled estimates."""


def kv_bytes_per_token(model: ModelProfile) -> int:
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes


def kv_capacity_blocks(
    model: ModelProfile, gpu: GpuProfile, gpu_memory_utilization: float, block_size: int
) -> int:
    """KV blocks vLLM would allocate; 0 when the weights alone do not fit."""
    free = gpu.memory_bytes * gpu_memory_utilization - model.weight_bytes - RUNTIME_RESERVE_BYTES
    return max(0, int(free // (kv_bytes_per_token(model) * block_size)))


def kv_capacity_tokens(
    model: ModelProfile, gpu: GpuProfile, gpu_memory_utilization: float, block_size: int
) -> int:
    return kv_capacity_blocks(model, gpu, gpu_memory_utilization, block_size) * block_size


def step_coefficients(model: ModelProfile, gpu: GpuProfile) -> StepCoefficients:
    """Measured coefficients for the pair if any, else the GPU's scaled to the model.

    The weight-read floor, the compute slope and prefill attention scale with the weight
    bytes; the decode KV term with the KV bytes per token (which is how CALIBRATION's
    Llama-3-8B k_kv relates to Llama-2-7B's: 128 / 512 KiB × 0.32 µs = 0.08 µs); the
    per-step CPU overhead c0 does not depend on the model.
    """
    measured = MEASURED_STEP.get((model.name, gpu.name))
    if measured is not None:
        return measured
    ref = MODELS[REFERENCE_MODEL]
    weights = model.weight_bytes / ref.weight_bytes
    kv = kv_bytes_per_token(model) / kv_bytes_per_token(ref)
    step = gpu.step
    return StepCoefficients(
        c0_ms=step.c0_ms,
        F_ms=step.F_ms * weights,
        s_ms_per_token=step.s_ms_per_token * weights,
        k_kv_ms_per_token=step.k_kv_ms_per_token * kv,
        k_pf_ms=step.k_pf_ms * weights,
    )
