"""One worker as the pacing rule (``capacity``) sees it: its latest reports, its budgets
in each dimension and its prefill queue (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

WorkerStatus = Literal["starting", "serving", "draining", "stopped"]


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    worker_timeout_s: float = 10.0
    slack: int = 2
    ledger_ttl_s: float = 600.0
    prefill_steps: float = 4.0
    """Prompt tokens waiting for their first token, per worker, in engine steps'
    worth (``max_num_batched_tokens`` each)."""
    kv_fill: float = 0.9
    """The share of a worker's KV cache reservations may fill, before ``kv_scale``."""
    kv_high: float = 0.9
    kv_step: float = 0.05
    kv_backoff: float = 0.7
    kv_scale_min: float = 0.3
    kv_scale_max: float = 1.5
    long_prompt_tokens: int = 1024
    """Placement: a prompt this long goes to the least loaded worker, a shorter one
    where the fewest prefill steps queue (0: every request to the least loaded)."""
    prefill_rate_decay: float = 0.05
    """A worker's learned prefill rate is the peak of its busy intervals' throughput (a
    queue at both ends does not mean the engine was prefilling all along, so a sample
    may measure the load, never more than the capacity), forgotten by this share per
    busy interval (an engine that slows down is followed)."""
    vip_reserve: float = 0.0
    """The share of every budget only VIP requests may use (off by default: see
    ``AdmissionSettings.vip_reserve``)."""

    def __post_init__(self) -> None:
        if self.worker_timeout_s <= 0 or self.ledger_ttl_s <= 0 or self.slack < 0:
            raise ValueError("timeouts must be positive and the slack not negative")
        if self.prefill_steps <= 0 or not 0 < self.kv_fill <= 1 or not 0 < self.kv_high <= 1:
            raise ValueError("prefill_steps must be positive, kv_fill and kv_high in (0, 1]")
        if not 0 < self.kv_scale_min <= 1 <= self.kv_scale_max or self.kv_step < 0:
            raise ValueError("need 0 < kv_scale_min <= 1 <= kv_scale_max and kv_step >= 0")
        if not 0 < self.kv_backoff < 1 or not 0 <= self.vip_reserve < 1:
            raise ValueError("kv_backoff must lie in (0, 1) and vip_reserve in [0, 1)")


@dataclass(slots=True)
class WorkerState:
    pool: str
    batch_limit: int
    in_flight: int
    reported_at: float
    """When its latest ``in_flight`` report was read."""
    heard_at: float
    """When anything of it was last read (liveness)."""
    status: WorkerStatus = "serving"
    completed_since_report: int = 0
    """Completions its latest report does not reflect."""
    completed_total: int = 0
    """``completed_total`` of its latest report."""
    completed_seq: int = 0
    """The highest ``seq`` of its completions read."""
    engine: Engine | None = None
    """From its latest ``EngineStats``; ``None`` until one says."""
    kv_scale: float = 1.0
    preempted_total: int | None = None
    partitions: tuple[int, ...] = ()
    """The pool's dispatch partitions it owns, from its latest heartbeat."""
    engine_at: float = 0.0
    """When its latest ``EngineStats`` was read."""
    prefill_rate: float | None = None
    """Prompt tokens per second its engine prefills when it has a queue (learned)."""

    def budgets(self, part: float, c: CapacityConfig) -> tuple[int, int, int]:
        """Its batch slots, KV and prefill budgets at ``part`` of its capacity (the pool
        breaker's factor times its own share); token budgets 0 without ``EngineStats``."""
        slots = max(1, math.floor(self.batch_limit * part))
        e = self.engine
        if e is None:
            return slots, 0, 0
        kv = math.floor(e.kv_capacity_tokens * c.kv_fill * self.kv_scale * part)
        return slots, kv, math.floor(e.max_num_batched_tokens * c.prefill_steps * part)

    def prefill_pending(self, now: float, since_report: int = 0) -> int:
        """Its prefill queue now: reported, plus ``since_report`` tokens placed on it
        since, drained at its learned rate for the time since the report."""
        if self.engine is None:
            return since_report
        drained = (self.prefill_rate or 0.0) * max(0.0, now - self.engine_at)
        return max(0, math.ceil(self.engine.prefill_pending_tokens + since_report - drained))


@dataclass(frozen=True, slots=True)
class Engine:
    """What a worker's ``EngineStats`` says of its engine's token capacity and use."""

    kv_capacity_tokens: int = 0
    max_num_batched_tokens: int = 0
    kv_cache_usage: float = 0.0
    prefill_pending_tokens: int = 0
    preempted_total: int = 0
    prefilled_tokens_total: int = 0
