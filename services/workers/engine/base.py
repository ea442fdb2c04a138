"""The inference engine interface the worker drives.

Three implementations stand behind it: the simulated engine (the embedded default and
the benchmark engine), the in-process vLLM adapter (extra ``vllm``), and the
OpenAI-HTTP adapter that drives a separately running ``vllm serve``. The worker knows
only this module: it submits requests, consumes their token deltas, aborts abandoned
ones and samples scheduler statistics.

These types are engine-side, not wire types: the worker translates between them and
``schemas``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Limits fixed when the engine starts (vLLM cannot change them at run time)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    gpu_memory_utilization: float
    kv_capacity_tokens: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    priority: int = 0
    """Lower runs first, as in vLLM's ``priority`` argument."""
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """A delta: the text and token count generated since the previous output."""

    request_id: str
    text: str
    new_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """Cumulative completion tokens, including this delta."""
    error: str | None = None


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Scheduler statistics, sampled by the worker about once a second."""

    running: int
    waiting: int
    preempted_total: int
    kv_cache_usage: float
    """0.0 – 1.0."""
    limits: EngineLimits
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class EngineCounters(Protocol):
    """What every engine's statistics count, however it reads them (its own scheduler,
    vLLM's stat logger, a server's ``/metrics``)."""

    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def preempted_total(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def prompt_tokens_total(self) -> int: ...
    @property
    def generation_tokens_total(self) -> int: ...


def snapshot_of(
    counters: EngineCounters, limits: EngineLimits, extra: dict[str, float] | None = None
) -> EngineSnapshot:
    """The snapshot every engine reports, from its counters and fixed limits."""
    return EngineSnapshot(
        running=counters.running,
        waiting=counters.waiting,
        preempted_total=counters.preempted_total,
        kv_cache_usage=counters.kv_cache_usage,
        limits=limits,
        prompt_tokens_total=counters.prompt_tokens_total,
        generation_tokens_total=counters.generation_tokens_total,
        extra=extra or {},
    )


class EngineError(RuntimeError):
    """The engine itself failed (crashed, stopped, unreachable): the worker exits, so
    that a fresh engine replaces it, and its requests go to the rest of the pool."""


class RequestRefused(ValueError):
    """The engine will not run this one request (a prompt longer than its context,
    parameters it does not take): the worker answers the request with an error and
    carries on. The message never quotes the prompt."""


@runtime_checkable
class Engine(Protocol):
    """What every engine provides. ``start``/``stop`` are idempotent."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream deltas; the last one has ``finished=True``. Raises ``RequestRefused``
        for a request it will not run, ``EngineError`` when it fails itself."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def snapshot(self) -> EngineSnapshot: ...

    @property
    def limits(self) -> EngineLimits: ...

    async def profile(self, seconds: float, path: Path) -> str:
        """Profile the engine for ``seconds`` (``path``: where a trace of the worker's
        own may go); where the trace is."""
        ...


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU sample, from NVML or from the simulated engine (``simulated=True``)."""

    index: int
    name: str
    utilization_pct: float | None
    """``None`` (as every optional figure): the device does not report it (a MIG
    instance, some boards)."""
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    temperature_c: float | None
    power_w: float | None
    power_limit_w: float | None
    pcie_tx_kbps: float = 0.0
    pcie_rx_kbps: float = 0.0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    clock_event_reasons: tuple[str, ...] = ()
    memory_utilization_pct: float | None = 0.0
    """Share of the last sample period the memory was read or written (NVML's memory
    utilization, DCGM's ``DEV_MEM_COPY_UTIL``): how busy memory bandwidth is."""
    process_memory_bytes: int | None = None
    """The memory of this worker's own processes on the device (``None``: not known;
    the device's use stands for it)."""
    simulated: bool = False
