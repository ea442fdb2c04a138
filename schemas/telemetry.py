"""What workers report on ``llm.telemetry``, keyed by pool (any key works: the
controller re-keys what is not on its pool's partition)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from schemas.base import (
    Count,
    Fraction,
    Ident,
    Message,
    Milliseconds,
    Percent,
    ShortText,
    Timestamp,
    TokenCount,
    Wire,
)
from schemas.requests import Priority, Tier


class RequestCompleted(Message):
    """One per request a worker finished (any outcome)."""

    type: Literal["request_completed"] = "request_completed"
    worker_id: Ident
    pool: Ident
    request_id: Ident
    tenant: Ident
    priority: Priority
    tier: Tier
    queue_wait_ms: Milliseconds
    """Admission's dispatch to the worker's start of work."""
    ttft_ms: Milliseconds | None = None
    latency_ms: Milliseconds
    """Start of work to the terminal reply."""
    prompt_tokens: TokenCount
    completion_tokens: TokenCount
    error: ShortText | None = None
    at: Timestamp


class EngineLimitsInfo(Wire):
    max_num_seqs: int = Field(ge=1, le=65_536)
    max_num_batched_tokens: int = Field(ge=1, le=10_000_000)
    block_size: int = Field(ge=1, le=1024)
    kv_capacity_tokens: int = Field(ge=0, le=1_000_000_000)
    max_model_len: int = Field(default=0, ge=0, le=10_000_000)
    """The longest sequence (prompt + output tokens) the engine runs; 0 when unknown.
    Admission refuses what no worker of the pool could run."""
    gpu_memory_utilization: Fraction = 0.0
    """The share of GPU memory the engine reserves when it starts (vLLM preallocates it
    for weights and the KV cache); 0 when unknown. The controller's GPU-memory breaker
    measures use of the headroom beyond it, not raw use, which sits at this share on a
    healthy vLLM."""


class EngineStats(Message):
    """Scheduler pressure, about once a second."""

    type: Literal["engine_stats"] = "engine_stats"
    worker_id: Ident
    pool: Ident
    engine: Ident
    running: Count
    waiting: Count
    preempted_total: Count
    kv_cache_usage: Fraction
    in_flight: Count
    batch_limit: int = Field(ge=1, le=65_536)
    limits: EngineLimitsInfo
    at: Timestamp
    prefill_pending_tokens: Count = 0
    """Prompt tokens of the requests the worker runs that have no first token yet: the
    prefill work queued in its engine, which admission paces against."""
    prefilled_tokens_total: Count = 0
    """Prompt tokens whose prefill finished (their request's first token came) since
    the worker started: from two reports admission learns how fast it prefills."""


class GpuStats(Message):
    """One GPU's state from NVML, or from the simulated engine (``simulated=True``)."""

    type: Literal["gpu_stats"] = "gpu_stats"
    worker_id: Ident
    pool: Ident
    gpu_index: int = Field(ge=0, le=1024)
    name: ShortText
    utilization_pct: Percent
    memory_used_bytes: Count
    memory_total_bytes: Count
    temperature_c: float = Field(ge=-50, le=200)
    power_w: float = Field(ge=0, le=100_000)
    power_limit_w: float = Field(ge=0, le=100_000)
    pcie_tx_kbps: float = Field(default=0, ge=0, le=1e9)
    pcie_rx_kbps: float = Field(default=0, ge=0, le=1e9)
    ecc_corrected: Count = 0
    ecc_uncorrected: Count = 0
    clock_event_reasons: tuple[Annotated[str, Field(max_length=64)], ...] = Field(
        default=(), max_length=32
    )
    simulated: bool
    at: Timestamp


class WorkerHeartbeat(Message):
    """Liveness, about once a second; its absence removes the worker from its pool."""

    type: Literal["worker_heartbeat"] = "worker_heartbeat"
    worker_id: Ident
    pool: Ident
    engine: Ident
    status: Literal["starting", "serving", "draining", "stopped"]
    in_flight: Count
    batch_limit: int = Field(ge=1, le=65_536)
    host_cpu_pct: Percent
    host_memory_pct: Percent
    started_at: Timestamp
    at: Timestamp
    partitions: tuple[Annotated[int, Field(ge=0, le=1_000_000)], ...] = Field(
        default=(), max_length=4096
    )
    """The pool's dispatch partitions the worker owns now (its consumer group's
    assignment): admission places requests on workers by producing to them."""


TelemetryEvent = Annotated[
    RequestCompleted | EngineStats | GpuStats | WorkerHeartbeat, Field(discriminator="type")
]
