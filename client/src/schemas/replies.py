"""What a client receives on its reply topic: chunks, then exactly one terminal reply."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from schemas.base import Ident, LongText, Message, Seconds, ShortText, Timestamp, TokenCount, Wire


class ReplyStatus(StrEnum):
    OK = "ok"
    DEGRADED = "degraded"
    REJECTED = "rejected"
    ERROR = "error"
    EXPIRED = "expired"


class ReasonCode(StrEnum):
    """Why a reply is not a plain ``ok``; stable strings clients may switch on."""

    NONE = "none"
    QUOTA_EXCEEDED = "quota_exceeded"
    QUOTA_DEGRADED = "quota_degraded"
    SCAVENGED = "scavenged"
    """Over its tenant's quota, and served anyway from capacity nobody else wanted at
    the time (admission's scavenger class); the quota itself was not charged."""
    REGION_THROTTLED = "region_throttled"
    BREAKER_OPEN = "breaker_open"
    OVERLOADED = "overloaded"
    DEGRADED_SMALL_MODEL = "degraded_small_model"
    DEGRADED_TRUNCATED = "degraded_truncated"
    DEGRADED_STATIC = "degraded_static"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INVALID_REQUEST = "invalid_request"
    SENSITIVE_DATA = "sensitive_data"
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    ENGINE_ERROR = "engine_error"
    WORKER_SHUTDOWN = "worker_shutdown"
    QUOTA_UNAVAILABLE = "quota_unavailable"
    CANCELLED = "cancelled"
    """The client went away before the request was dispatched."""
    REPLY_UNDELIVERABLE = "reply_undeliverable"
    STREAM_INTERRUPTED = "stream_interrupted"
    """The worker streaming the reply failed after text had reached the client, and
    another worker started the request again: the text streamed so far is void. Sent
    by the client side (the SDK, the HTTP front) to end the stream, never by a worker."""


FinishReason = Literal["stop", "length", "abort", "error"]


class RateLimitInfo(Wire):
    """The values behind ``X-RateLimit-*`` and ``Retry-After``."""

    limit: int = Field(ge=0, le=2**31)
    remaining: int = Field(ge=0, le=2**31)
    reset_s: Seconds
    """Seconds until the bucket is full again."""
    retry_after_s: Seconds = 0.0


Generation = Annotated[int, Field(ge=0, le=2**62)]
"""Which start of a request's generation produced a reply: a worker takes a new one,
higher than every earlier one (microseconds since the epoch, or one more than the
last), each time it starts the request. 0: not produced by a worker (a rejection)."""


class ReplyChunk(Message):
    """Streamed tokens, coalesced: a handful of chunks per reply, not one per token.
    ``seq`` counts within a ``generation``: a request started again (its worker died)
    streams a new generation from ``seq`` 0, and readers drop the superseded one."""

    type: Literal["reply_chunk"] = "reply_chunk"
    request_id: Ident
    seq: int = Field(ge=0, le=1_000_000)
    generation: Generation = 0
    text: LongText
    tokens: TokenCount = 0
    worker_id: Ident | None = None


class InferenceReply(Message):
    """The one terminal reply of a request. Duplicates (at-least-once) repeat its
    ``request_id``; clients keep the first."""

    type: Literal["inference_reply"] = "inference_reply"
    request_id: Ident
    status: ReplyStatus
    reason: ReasonCode = ReasonCode.NONE
    code: Ident | None = None
    """A more specific, stable code where there is one (``context_length_exceeded``,
    ``invalid_api_key``, …): OpenAI's error ``code`` over HTTP."""
    message: ShortText = ""
    text: LongText = ""
    prompt_tokens: TokenCount = 0
    completion_tokens: TokenCount = 0
    finish_reason: FinishReason | None = None
    chunks: int = Field(default=0, ge=0, le=1_000_000)
    """How many chunks preceded this reply (lets a streaming client tell a gap)."""
    rate_limit: RateLimitInfo | None = None
    worker_id: Ident | None = None
    generation: Generation = 0
    """The generation whose text this is (see ``ReplyChunk``)."""
    completed_at: Timestamp


ReplyMessage = Annotated[ReplyChunk | InferenceReply, Field(discriminator="type")]
