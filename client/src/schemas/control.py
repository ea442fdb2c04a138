"""Control events: the controller's decisions, each with the evidence behind it.

The control topic is keyed by ``control_key`` (``<kind>/<scope>``) and compacted in
Apache Kafka, so a consumer that starts at any point converges on the latest decision
per key. The embedded broker never compacts, so consumers must not rely on it either:
they apply events by ``seq`` (latest wins, see ``services.common.control_state``), and the
controller re-publishes the state in force periodically (level-triggered).
"""

from __future__ import annotations

from enum import IntEnum
from itertools import pairwise
from typing import Annotated, Literal, Self

from pydantic import Field, StringConstraints, model_validator

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
    incarnation: Ident | None = None
    """A worker's scope: the process (``WorkerHeartbeat.incarnation``) the decision was
    made about; an emergency restart is obeyed only by that one."""


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


CanaryPhase = Literal["checking", "ramping", "promoted", "rolled_back", "aborted"]
#: A canary version names a pool's release (``<pool>.canary-<version>``): no dot, so
#: the pool it releases into can always be read back from the canary's pool name.
Version = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
]


def check_steps(steps: tuple[float, ...]) -> None:
    """A canary's steps: increasing shares above 0, ending at 1 (all the traffic)."""
    if not steps or any(s <= 0 for s in steps) or any(a >= b for a, b in pairwise(steps)):
        raise ValueError(f"steps must be increasing shares above 0, got {steps}")
    if steps[-1] != 1.0:
        raise ValueError(f"the last step must be 1 (all of the pool's traffic), got {steps[-1]}")


class CanaryRelease(_Control):
    """An operator's canary command for a pool (``seawall canary``), scope ``pool:<pool>``.

    ``start`` releases ``version``, whose workers serve the pool
    ``<pool>.canary-<version>``: a check with no traffic (the canary's workers report
    and their breaker is closed for ``check_s``), then each of ``steps`` (the canary's
    share of the pool's traffic) for ``hold_s``, compared with the pool's own workers
    all along; the controller rolls back when a bound is crossed. ``promote`` and
    ``abort`` name the release they act on (``release``: the ``seq`` of its start) and
    repeat its terms, so the latest command of the key always holds them."""

    kind: Literal["canary"] = "canary"
    pool: Ident
    version: Version
    action: Literal["start", "promote", "abort"]
    release: int = Field(ge=0, le=2**62)
    """The ``seq`` of the release's ``start`` command (for ``start``, its own)."""
    steps: tuple[Fraction, ...] = Field(default=(0.05, 0.25, 0.5, 1.0), min_length=1, max_length=16)
    hold_s: Seconds = 300.0
    check_s: Seconds = 30.0
    min_requests: int = Field(default=20, ge=1, le=1_000_000)
    """Canary requests a step's last window needs before the step may pass (and before
    the canary is judged at all: a handful of requests proves nothing)."""
    max_error_rate_delta: Fraction = 0.02
    """Rolled back when the canary's error rate exceeds the pool's by more than this."""
    max_latency_ratio: float = Field(default=1.5, ge=1, le=100)
    """... or its latency P99 exceeds the pool's by more than this factor ..."""
    max_ttft_ratio: float = Field(default=1.5, ge=1, le=100)
    """... or its mean time to first token does ..."""
    max_mismatch_rate_delta: Fraction = 0.05
    """... or, where admission samples shadow runs (``consistency_sample``), the share
    of the canary's shadows of the pool's outputs that disagree exceeds the pool's own
    mismatch rate by more than this."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        check_steps(self.steps)
        if self.action == "start" and self.release != self.seq:
            raise ValueError("a start command is its own release (release == seq)")
        return self


class TrafficSplit(_Control):
    """Where a pool's traffic goes while a canary release runs, scope ``pool:<pool>``:
    a share per pool (the pool itself and its canary's pool), summing to 1. Admission
    sends a request to a pool by a hash of its session (or, without one, its request
    id), so a session stays on one side while the canary's share grows. The release's
    phase and step travel along, so that whichever controller instance owns the pool
    next resumes the release where it stood."""

    kind: Literal["traffic_split"] = "traffic_split"
    pool: Ident
    weights: dict[Ident, Fraction] = Field(min_length=1, max_length=16)
    version: Version | None = None
    release: int = Field(default=0, ge=0, le=2**62)
    phase: CanaryPhase | None = None
    step: int = Field(default=0, ge=0, le=16)
    since: Timestamp | None = None
    """When the phase (or, ramping, the step) began."""

    @model_validator(mode="after")
    def _sums_to_one(self) -> Self:
        if abs(sum(self.weights.values()) - 1.0) > 1e-6:
            raise ValueError("the weights must sum to 1")
        return self


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


class Profile(_Control):
    """Profiling one worker (``seawall profile``), scope ``worker:<id>``: an operator's
    request (``requested``), then the worker's own answers on the same key — ``running``,
    and ``written`` with where the trace is, or ``failed`` with why (the evidence's
    reason). ``request`` is the ``seq`` of the operator's request throughout."""

    kind: Literal["profile"] = "profile"
    worker_id: Ident
    request: int = Field(ge=0, le=2**62)
    seconds: float = Field(gt=0, le=600)
    status: Literal["requested", "running", "written", "failed"]
    path: ShortText | None = None
    """``written``: the trace (a ``pstats`` file for the simulated engine's ``cProfile``,
    vLLM's torch profiler directory for vLLM)."""


ControlEvent = Annotated[
    BreakerState
    | DegradationLevel
    | BatchLimit
    | TrafficSplit
    | CanaryRelease
    | RegionThrottle
    | QuotaOverride
    | Profile,
    Field(discriminator="kind"),
]
