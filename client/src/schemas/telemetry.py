"""What workers report.

Two streams, each sized for its readers:

- ``llm.telemetry``, keyed by pool (any key works: the controller re-keys what is not on
  its pool's partition): one ``WorkerReport`` per worker per report interval — its
  heartbeat, engine and GPU readings, and a ``RequestSummary`` of the requests it
  finished in the interval (counts, sums and a mergeable latency sketch). The
  controller's cost is per worker-second, whatever the request rate. Standalone
  heartbeats (a status change: draining, stopped) and readings are valid too.
- ``llm.completions``, keyed by pool: one ``RequestCompleted`` per request, for
  admission's accounting (the slot it frees, the tokens it actually used). The
  controller does not read it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from schemas.base import (
    Count,
    Fraction,
    Ident,
    Message,
    Milliseconds,
    Percent,
    Seconds,
    ShortText,
    Timestamp,
    TokenCount,
    Wire,
)
from schemas.requests import Priority, Tier

LONG_PROMPT_TOKENS = 4096
"""A prompt is long above this many tokens (DESIGN, "Pre-filter")."""


class RequestCompleted(Message):
    """One per request a worker finished (any outcome), on ``llm.completions``."""

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
    seq: Count = 0
    """The worker's count of finished requests, this one included (0: not counted). A
    report's ``completed_total`` says which completions it already reflects: the two
    streams are separate topics, read in no common order."""
    repeat: bool = False
    """Not a completion: a dispatch of a request this worker found already answered (a
    copy admission sent again after a restart). Nothing to count or correct; it only
    tells the dispatching admission that this dispatch holds no slot any more."""


SKETCH_RELATIVE_ACCURACY = 0.01
"""The relative accuracy of every latency sketch on the wire: sketches merge only with
the same log mapping (DDSketch, gamma = (1 + a) / (1 - a))."""
SKETCH_MAX_KEY = 2_000


class LatencySketch(Wire):
    """A DDSketch of latencies in milliseconds, relative accuracy
    ``SKETCH_RELATIVE_ACCURACY``: ``bins`` holds (key, count) for every non-empty bucket
    of the logarithmic mapping, ``zero_count`` the values too small for any (≈ 0 ms).
    Keys are bounded to ``SKETCH_MAX_KEY`` either way: 1 ns to 10^17 ms, far beyond any
    latency (a day is key 914), and the reader's dense store spans at most 4,001 bins
    however far apart a forged sketch puts them."""

    bins: tuple[tuple[Annotated[int, Field(ge=-SKETCH_MAX_KEY, le=SKETCH_MAX_KEY)], Count], ...] = (
        Field(default=(), max_length=2 * SKETCH_MAX_KEY + 1)
    )
    zero_count: Count = 0

    @property
    def count(self) -> int:
        return self.zero_count + sum(c for _, c in self.bins)


class RequestSummary(Wire):
    """The requests one worker finished in one report interval, as the controller uses
    them: counts, the latency distribution, and the sums its EWMAs and volatility need.
    Per-request accounting travels separately (``RequestCompleted``)."""

    window_s: Seconds
    """How long the interval lasted (it ends at the report's ``at``)."""
    count: Count
    errors: Count
    latency: LatencySketch
    """Start of work to terminal reply, every request (failed ones too: a timeout is
    exactly the tail P99 must show)."""
    latency_sum_ms: float = Field(ge=0, le=1e15)
    latency_m2_ms2: float = Field(ge=0, le=1e30)
    """The latencies' sum of squared deviations from their mean (Welford's ``M2``):
    pooled across intervals without the cancellation a sum of squares suffers."""
    ttft_count: Count = 0
    ttft_sum_ms: float = Field(default=0.0, ge=0, le=1e15)
    itl_count: Count = 0
    """Requests with a mean inter-token latency (a first token and at least two)."""
    itl_sum_ms: float = Field(default=0.0, ge=0, le=1e15)
    """The sum of those requests' mean inter-token latencies."""
    prompt_tokens: Count = 0
    completion_tokens: Count = 0
    long_prompts: Count = 0
    """Requests whose prompt had more than ``LONG_PROMPT_TOKENS`` tokens (DESIGN's long
    prompt: the controller alerts when their share passes 30 %)."""
    consistency_checks: Count = 0
    """Shadow runs compared with their original (``DispatchedRequest.shadow_of``): the
    output-consistency check of the worker's pool. Not among ``count``: a shadow
    answers nobody."""
    consistency_mismatches: Count = 0
    consistency_similarity_sum: float = Field(default=0.0, ge=0, le=2**53)
    """The sum of those comparisons' similarities (each within [0, 1])."""


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
    completed_total: Count = 0
    """As ``WorkerHeartbeat.completed_total``: what ``in_flight`` already excludes."""
    stalled_s: Seconds = 0.0
    """How long the engine has produced no token while it held requests (0: idle, or
    producing): the controller's ``engine_stalled_s`` breaker row reads it."""


class GpuStats(Message):
    """One GPU's state from NVML, or from the simulated engine (``simulated=True``).
    A figure the device does not report (a MIG instance has no utilization or power of
    its own; some boards report no power) is ``None``: missing, not zero."""

    type: Literal["gpu_stats"] = "gpu_stats"
    worker_id: Ident
    pool: Ident
    gpu_index: int = Field(ge=0, le=1024)
    name: ShortText
    utilization_pct: Percent | None
    memory_utilization_pct: Percent | None = 0.0
    """Memory bandwidth in use: the share of the sample period memory was read or
    written (NVML's memory utilization)."""
    memory_used_bytes: Count | None
    """The device's (or MIG instance's) memory in use, every process's."""
    memory_total_bytes: Count | None
    process_memory_bytes: Count | None = None
    """This worker's own processes' memory on the device (``None``: not attributable,
    e.g. NVML lists PIDs of another namespace): what the controller judges when known."""
    temperature_c: float | None = Field(ge=-50, le=200)
    power_w: float | None = Field(ge=0, le=100_000)
    power_limit_w: float | None = Field(ge=0, le=100_000)
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
    completed_total: Count = 0
    """The worker's finished requests so far (``RequestCompleted.seq`` of the latest):
    every request with a higher ``seq`` is still counted in ``in_flight``."""
    incarnation: Ident | None = None
    """A random id of this worker process. An emergency restart names the incarnation
    it orders to restart, so the process that replaces it never obeys the same order —
    whatever the two hosts' clocks say."""


class WorkerReport(Message):
    """One worker's report for one interval, in one record: what the controller and
    admission's pacing read, at a cost per worker-second rather than per request."""

    type: Literal["worker_report"] = "worker_report"
    worker_id: Ident
    pool: Ident
    at: Timestamp
    heartbeat: WorkerHeartbeat
    engine: EngineStats | None = None
    gpus: tuple[GpuStats, ...] = Field(default=(), max_length=64)
    requests: RequestSummary | None = None

    @model_validator(mode="after")
    def _one_worker(self) -> WorkerReport:
        parts: tuple[EngineStats | GpuStats | WorkerHeartbeat, ...] = (
            self.heartbeat,
            *((self.engine,) if self.engine is not None else ()),
            *self.gpus,
        )
        if any((p.worker_id, p.pool) != (self.worker_id, self.pool) for p in parts):
            raise ValueError("every part of a report is its own worker's and pool's")
        return self

    def parts(self) -> tuple[EngineStats | GpuStats | WorkerHeartbeat, ...]:
        """The readings, in the order a consumer applies them: the engine's limits
        before the GPU's memory they qualify, the heartbeat last."""
        engine = (self.engine,) if self.engine is not None else ()
        return (*engine, *self.gpus, self.heartbeat)


TelemetryEvent = Annotated[
    WorkerReport | EngineStats | GpuStats | WorkerHeartbeat, Field(discriminator="type")
]
