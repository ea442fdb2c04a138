"""The decider's configuration: the policies' own, the publication cadence, how long a
worker and its telemetry are heard, and the windows the policies read
(``DeciderConfig``); ``scaled_config``: the defaults on another time scale."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from services.controller.decider.evidence import MAX_SECONDS
from services.controller.policy import (
    BatchConfig,
    BreakerConfig,
    DegradationConfig,
    GaugeWindow,
    HeartbeatConfig,
    RequestWindow,
    Threshold,
)
from services.controller.policy.breaker import ERROR_RATE_ROW, LATENCY_ROW
from services.controller.policy.shares import OUTPUT_MISMATCH_RATE

REQUEST_BUCKETS = 30
GAUGE_BUCKETS = 10


@dataclass(frozen=True)
class DeciderConfig:
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    degradation: DegradationConfig = field(default_factory=DegradationConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    republish_s: float = 5.0
    valid_for_s: float = 60.0
    forget_after_s: float = 600.0
    max_telemetry_age_s: float = 30.0
    small_pool: str = "small"
    max_tokens_cap: int = 512
    host_cpu_breaker: bool = True
    """Whether heartbeats' host CPU feeds the breaker matrix. Off where workers share
    one host (the embedded stack): there it says nothing about any one worker."""
    output_mismatch_rate: Threshold = OUTPUT_MISMATCH_RATE
    """The output-consistency alert's bound (``policy.shares``)."""

    def __post_init__(self) -> None:
        if not 0 < self.republish_s < self.valid_for_s <= MAX_SECONDS:
            raise ValueError(
                "need 0 < republish_s < valid_for_s <= 86400: decisions must not expire at "
                "their consumers between two re-publications"
            )
        if self.forget_after_s <= 0 or self.max_telemetry_age_s <= 0:
            raise ValueError("forget_after_s and max_telemetry_age_s must be > 0")

    @property
    def request_window_s(self) -> float:
        """The longest window any request-based row or rung reads."""
        rows = (self.breaker.error_rate, self.breaker.latency_p99_ms)
        rungs = (self.degradation.latency_p99_ms, self.degradation.error_rate)
        return max(t.window_s for t in (*rows, *rungs))

    @property
    def gauge_window_s(self) -> float:
        rows = (
            self.breaker.cpu_percent,
            self.breaker.gpu_memory_percent,
            self.breaker.engine_stalled_s,
        )
        rungs = (self.degradation.gpu_temperature_c, self.degradation.preemptions_per_s)
        return max(t.window_s for t in (*rows, *rungs))

    def request_window(self) -> RequestWindow:
        size = self.request_window_s
        return RequestWindow(size, size / REQUEST_BUCKETS)

    def gauge_window(self) -> GaugeWindow:
        size = self.gauge_window_s
        return GaugeWindow(size, size / GAUGE_BUCKETS)


def _scaled(t: Threshold, k: float) -> Threshold:
    return replace(
        t,
        window_s=t.window_s * k,
        trip_hold_s=t.trip_hold_s * k,
        recover_hold_s=t.recover_hold_s * k,
    )


def scaled_config(
    time_scale: float,
    *,
    batch_sla_ms: float,
    heartbeat_timeout_s: float,
    republish_s: float,
    valid_for_s: float,
    forget_after_s: float,
    max_telemetry_age_s: float,
    small_pool: str,
    max_tokens_cap: int,
    host_cpu_breaker: bool = True,
    error_rate_trip: float = ERROR_RATE_ROW.trip_above,
    error_rate_recover: float = ERROR_RATE_ROW.recover_below,
    latency_trip_ms: float = LATENCY_ROW.trip_above,
    latency_recover_ms: float = LATENCY_ROW.recover_below,
    ttft_slo_ms: float | None = None,
    itl_slo_ms: float | None = None,
    output_mismatch_rate: float = OUTPUT_MISMATCH_RATE.trip_above,
) -> DeciderConfig:
    """The default policies with every window and hold multiplied by ``time_scale``, and
    the error-rate and latency rows' thresholds as given (DESIGN's 2000/800 ms fit a
    fleet whose normal P99 is well under 800 ms; one that runs near 1.2 s would never
    recover below 800)."""
    k = time_scale
    d = DegradationConfig()
    b = BreakerConfig(
        error_rate=replace(
            ERROR_RATE_ROW, trip_above=error_rate_trip, recover_below=error_rate_recover
        ),
        latency_p99_ms=replace(
            LATENCY_ROW, trip_above=latency_trip_ms, recover_below=latency_recover_ms
        ),
    )
    return DeciderConfig(
        breaker=replace(
            b,
            error_rate=_scaled(b.error_rate, k),
            latency_p99_ms=_scaled(b.latency_p99_ms, k),
            cpu_percent=_scaled(b.cpu_percent, k),
            gpu_memory_percent=_scaled(b.gpu_memory_percent, k),
            engine_stalled_s=_scaled(b.engine_stalled_s, k),
            probe_retry_s=b.probe_retry_s * k,
        ),
        degradation=DegradationConfig(
            latency_p99_ms=_scaled(d.latency_p99_ms, k),
            error_rate=_scaled(d.error_rate, k),
            gpu_temperature_c=_scaled(d.gpu_temperature_c, k),
            preemptions_per_s=_scaled(d.preemptions_per_s, k),
        ),
        batch=replace(
            BatchConfig(),
            sla_ms=batch_sla_ms,
            ttft_slo_ms=ttft_slo_ms,
            itl_slo_ms=itl_slo_ms,
            min_interval_s=BatchConfig().min_interval_s * k,
            preemption_hold_s=BatchConfig().preemption_hold_s * k,
            queue_hold_s=BatchConfig().queue_hold_s * k,
        ),
        heartbeat=HeartbeatConfig(timeout_s=heartbeat_timeout_s),
        republish_s=republish_s,
        valid_for_s=valid_for_s,
        forget_after_s=forget_after_s,
        max_telemetry_age_s=max_telemetry_age_s,
        small_pool=small_pool,
        max_tokens_cap=max_tokens_cap,
        host_cpu_breaker=host_cpu_breaker,
        output_mismatch_rate=_scaled(
            replace(
                OUTPUT_MISMATCH_RATE,
                trip_above=output_mismatch_rate,
                recover_below=output_mismatch_rate / 2,
            ),
            k,
        ),
    )
