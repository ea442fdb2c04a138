"""Control events: the controller's decisions, each with the evidence behind it.

The control topic is keyed by ``control_key`` (``<kind>/<scope>``) and compacted in
Apache Kafka, so a consumer that starts at any point converges on the latest decision
per key. The embedded broker never compacts, so consumers must not rely on it either:
they apply events by ``seq`` (latest wins, see ``services.common.control``), and the
controller re-publishes the state in force periodically (level-triggered).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from schemas.base import Fraction, Ident, Message, Seconds, ShortText, Timestamp, Wire

MetricName = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class Evidence(Wire):
    """The numbers that caused a decision, so an operator can check it."""

    reason: ShortText
    window_s: Seconds = 0.0
    metrics: dict[MetricName, float] = Field(default_factory=dict, max_length=32)
    thresholds: dict[MetricName, float] = Field(default_factory=dict, max_length=32)
    hold_s: Seconds | None = None
    """How long the condition held (recoveries) or must hold."""
    previous: ShortText | None = None
    """The state this decision replaces."""


class _Control(Message):
    scope: Ident
    """What the decision applies to: ``pool:<name>``, ``worker:<id>``, ``region:<name>``,
    ``tenant:<name>``, or ``fleet``."""
    seq: int = Field(ge=0, le=2**62)
    """Increases with every event an issuer emits; consumers keep the highest per key."""
    issued_at: Timestamp
    valid_for_s: Seconds = 60.0
    """How long the decision may be trusted without being re-published."""
    issuer: Ident = "controller"
    evidence: Evidence

    @property
    def control_key(self) -> str:
        kind: str = getattr(self, "kind")  # noqa: B009  (every subclass defines it)
        return f"{kind}/{self.scope}"


class BreakerLevel(IntEnum):
    """Action levels of DESIGN's breaker matrix."""

    NONE = 0
    LOG = 1
    RATE_LIMIT = 2
    REJECT_NEW = 3
    EMERGENCY = 4
    """Restart the worker (GPU memory)."""


class BreakerState(_Control):
    kind: Literal["breaker"] = "breaker"
    state: Literal["closed", "open", "half_open"]
    level: BreakerLevel = BreakerLevel.NONE
    tripped: tuple[MetricName, ...] = Field(default=(), max_length=8)
    """The matrix rows (signals) currently tripped."""
    probe_requests: int = Field(default=0, ge=0, le=1000)
    """Half-open: how many probe requests may pass."""


class DegradationLevel(_Control):
    kind: Literal["degradation"] = "degradation"
    level: int = Field(ge=0, le=3)
    small_pool: Ident | None = None
    """Level 1: where non-VIP work is diverted."""
    max_tokens_cap: int | None = Field(default=None, ge=1, le=32_768)
    """Level 2: the cap applied to long requests."""


class BatchLimit(_Control):
    kind: Literal["batch_limit"] = "batch_limit"
    worker_id: Ident
    limit: int = Field(ge=1, le=1024)


class TrafficSplit(_Control):
    """Canary weights of a pool's model versions; they sum to 1."""

    kind: Literal["traffic_split"] = "traffic_split"
    pool: Ident
    weights: dict[Ident, Fraction] = Field(min_length=1, max_length=16)


class RegionThrottle(_Control):
    kind: Literal["region_throttle"] = "region_throttle"
    region: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    rate_per_s: float | None = Field(default=None, ge=0, le=1e6)
    """Admitted requests per second from the region; ``None`` lifts the throttle."""


class QuotaOverride(_Control):
    kind: Literal["quota_override"] = "quota_override"
    tenant: Ident
    requests_per_s: float | None = Field(default=None, ge=0, le=1e6)
    tokens_per_s: float | None = Field(default=None, ge=0, le=1e9)
    burst: float | None = Field(default=None, ge=0, le=1e9)
    expires_at: Timestamp | None = None


ControlEvent = Annotated[
    BreakerState | DegradationLevel | BatchLimit | TrafficSplit | RegionThrottle | QuotaOverride,
    Field(discriminator="kind"),
]
