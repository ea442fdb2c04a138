"""Check engine settings against the risk thresholds in DESIGN ("vLLM settings").

Pure: no I/O, no engine. The worker calls :func:`validate_limits` at start and logs each
warning; nothing here refuses to start, because vLLM itself rejects what it cannot run
and an operator may accept a known risk.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.workers.engine.base import EngineLimits


@dataclass(frozen=True, slots=True)
class RiskThresholds:
    """Where each setting becomes risky. Defaults are the seeds' figures."""

    max_num_seqs: int = 80
    max_num_batched_tokens: int = 12_000
    min_block_size: int = 16
    max_gpu_memory_utilization: float = 0.95


@dataclass(frozen=True, slots=True)
class SettingWarning:
    setting: str
    value: float
    threshold: float
    reason: str

    def __str__(self) -> str:
        return f"{self.setting}={self.value:g} (threshold {self.threshold:g}): {self.reason}"


DEFAULT_THRESHOLDS = RiskThresholds()


def validate_engine_settings(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    block_size: int,
    gpu_memory_utilization: float | None,
    thresholds: RiskThresholds = DEFAULT_THRESHOLDS,
) -> tuple[SettingWarning, ...]:
    """Return one warning per risky or invalid setting, in a stable order.

    ``None`` means "left to vLLM's default" and is not checked.
    """
    warnings: list[SettingWarning] = []
    if max_num_seqs < 1:
        warnings.append(
            SettingWarning("max_num_seqs", max_num_seqs, 1, "must be at least 1: nothing can run")
        )
    elif max_num_seqs > thresholds.max_num_seqs:
        warnings.append(
            SettingWarning(
                "max_num_seqs",
                max_num_seqs,
                thresholds.max_num_seqs,
                "latency spikes: every decode step carries this many sequences",
            )
        )
    if max_num_batched_tokens is not None:
        if max_num_batched_tokens > thresholds.max_num_batched_tokens:
            warnings.append(
                SettingWarning(
                    "max_num_batched_tokens",
                    max_num_batched_tokens,
                    thresholds.max_num_batched_tokens,
                    "OOM risk: activation memory per step grows with the token budget",
                )
            )
        if max_num_batched_tokens < max_num_seqs:
            # vLLM refuses this combination: a full batch could not decode one token each.
            warnings.append(
                SettingWarning(
                    "max_num_batched_tokens",
                    max_num_batched_tokens,
                    max_num_seqs,
                    "below max_num_seqs: vLLM will refuse to start",
                )
            )
    if block_size < thresholds.min_block_size:
        warnings.append(
            SettingWarning(
                "block_size",
                block_size,
                thresholds.min_block_size,
                "half efficiency, as measured in the seed deployment",
            )
        )
    if gpu_memory_utilization is not None:
        if not 0.0 < gpu_memory_utilization <= 1.0:
            warnings.append(
                SettingWarning(
                    "gpu_memory_utilization",
                    gpu_memory_utilization,
                    1.0,
                    "must lie in (0, 1]: it is a fraction of the GPU's memory",
                )
            )
        elif gpu_memory_utilization > thresholds.max_gpu_memory_utilization:
            warnings.append(
                SettingWarning(
                    "gpu_memory_utilization",
                    gpu_memory_utilization,
                    thresholds.max_gpu_memory_utilization,
                    "OOM risk: too little headroom for CUDA graphs, NCCL and other processes",
                )
            )
    return tuple(warnings)


def validate_limits(
    limits: EngineLimits, thresholds: RiskThresholds = DEFAULT_THRESHOLDS
) -> tuple[SettingWarning, ...]:
    """Validate the limits an engine reports after it started."""
    return validate_engine_settings(
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        block_size=limits.block_size,
        gpu_memory_utilization=limits.gpu_memory_utilization,
        thresholds=thresholds,
    )
