"""seawall's wire contract: the only thing services share on Kafka.

One module per event family; each top-level message is a frozen pydantic model with a
``schema_version``. ``TOP_LEVEL`` lists what is exported as JSON Schema into
``schemas/json/`` for producers in other languages (``python -m schemas.export``).
"""

from schemas.audit import AuditEvent
from schemas.base import SCHEMA_VERSION, Message
from schemas.control import (
    BatchLimit,
    BreakerLevel,
    BreakerState,
    ControlEvent,
    DegradationLevel,
    Evidence,
    QuotaOverride,
    RegionThrottle,
    TrafficSplit,
)
from schemas.deadletter import DeadLetter
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
    Priority,
    SamplingParams,
    Tier,
)
from schemas.telemetry import (
    EngineLimitsInfo,
    EngineStats,
    GpuStats,
    RequestCompleted,
    TelemetryEvent,
    WorkerHeartbeat,
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
    BreakerState,
    DegradationLevel,
    BatchLimit,
    TrafficSplit,
    RegionThrottle,
    QuotaOverride,
    AuditEvent,
    DeadLetter,
)

__all__ = [
    "SCHEMA_VERSION",
    "TIER_PRIORITY",
    "TOP_LEVEL",
    "AbortRequest",
    "AuditEvent",
    "BatchLimit",
    "BreakerLevel",
    "BreakerState",
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
    "Message",
    "Priority",
    "QuotaOverride",
    "RateLimitInfo",
    "ReasonCode",
    "RegionThrottle",
    "ReplyChunk",
    "ReplyMessage",
    "ReplyStatus",
    "RequestCompleted",
    "SamplingParams",
    "TelemetryEvent",
    "Tier",
    "TrafficSplit",
    "WorkerHeartbeat",
]
