"""seawall's wire contract: the only thing services share on Kafka.

One module per event family; each top-level message is a frozen pydantic model with a
``schema_version``. ``TOP_LEVEL`` lists what is exported as JSON Schema into
``schemas/json/`` for producers in other languages (``python -m schemas.export``).
"""

from schemas.alerts import Alert
from schemas.arrivals import RegionArrivals
from schemas.audit import AuditEvent
from schemas.base import SCHEMA_VERSION, Message
from schemas.control import (
    BatchLimit,
    BreakerLevel,
    BreakerState,
    CanaryRelease,
    ControlEvent,
    DegradationLevel,
    Evidence,
    Profile,
    QuotaOverride,
    RegionThrottle,
    TrafficSplit,
)
from schemas.deadletter import DeadLetter
from schemas.hints import QuotaHint
from schemas.replies import (
    InferenceReply,
    RateLimitInfo,
    ReasonCode,
    ReplyChunk,
    ReplyMessage,
    ReplyStatus,
)
from schemas.requests import (
    TIER_PRIORITY,
    AbortRequest,
    ChatMessage,
    ClientMeta,
    Degradation,
    DispatchedRequest,
    InferenceRequest,
    OutputFingerprint,
    Priority,
    SamplingParams,
    ShadowOf,
    ShadowOrder,
    Tier,
)
from schemas.telemetry import (
    EngineLimitsInfo,
    EngineStats,
    GpuStats,
    LatencySketch,
    RequestCompleted,
    RequestSummary,
    TelemetryEvent,
    WorkerHeartbeat,
    WorkerReport,
)

TOP_LEVEL: tuple[type[Message], ...] = (
    InferenceRequest,
    AbortRequest,
    DispatchedRequest,
    ReplyChunk,
    InferenceReply,
    RequestCompleted,
    EngineStats,
    GpuStats,
    WorkerHeartbeat,
    WorkerReport,
    BreakerState,
    DegradationLevel,
    BatchLimit,
    TrafficSplit,
    CanaryRelease,
    RegionThrottle,
    QuotaOverride,
    Profile,
    QuotaHint,
    AuditEvent,
    DeadLetter,
    Alert,
    RegionArrivals,
)

__all__ = [
    "SCHEMA_VERSION",
    "TIER_PRIORITY",
    "TOP_LEVEL",
    "AbortRequest",
    "Alert",
    "AuditEvent",
    "BatchLimit",
    "BreakerLevel",
    "BreakerState",
    "CanaryRelease",
    "ChatMessage",
    "ClientMeta",
    "ControlEvent",
    "DeadLetter",
    "Degradation",
    "DegradationLevel",
    "DispatchedRequest",
    "EngineLimitsInfo",
    "EngineStats",
    "Evidence",
    "GpuStats",
    "InferenceReply",
    "InferenceRequest",
    "LatencySketch",
    "Message",
    "OutputFingerprint",
    "Priority",
    "Profile",
    "QuotaHint",
    "QuotaOverride",
    "RateLimitInfo",
    "ReasonCode",
    "RegionArrivals",
    "RegionThrottle",
    "ReplyChunk",
    "ReplyMessage",
    "ReplyStatus",
    "RequestCompleted",
    "RequestSummary",
    "SamplingParams",
    "ShadowOf",
    "ShadowOrder",
    "TelemetryEvent",
    "Tier",
    "TrafficSplit",
    "WorkerHeartbeat",
    "WorkerReport",
]
