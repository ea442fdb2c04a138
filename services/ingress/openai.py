"""The OpenAI-compatible surface: request bodies, responses, stream chunks and errors,
and their translation to and from ``InferenceRequest`` / ``InferenceReply``.

Pure: no I/O. Unknown request fields are ignored, as vLLM's server does (clients send
many: ``frequency_penalty``, ``logprobs``, ...); the ones we cannot honour with a
different meaning (``n`` other than 1) are refused. Chat content may be a string or a
list of text parts. The deadline a client may ask for: the ``timeout`` body field or the
``X-Seawall-Timeout`` header, in seconds (capped by the server's default).

Status mapping (errors in OpenAI's shape ``{"error": {message, type, param, code}}``,
``code`` being the reply's specific ``code`` where it has one, else the stable refusal
code or ``ReasonCode``):

| cause                                                             | status            |
|-------------------------------------------------------------------|-------------------|
| bad JSON, UTF-8 or schema; absurd ``max_tokens``; sensitive data   | 400               |
| under a ``block`` policy; longer than the pool's context          |                   |
| (``context_length_exceeded``; ``engine_refused`` from an engine)  |                   |
| missing, unknown, wrongly signed, retired or revoked key          | 401               |
| too many failed authentications from the client's address         | 429, Retry-After  |
| blacklisted User-Agent; a read-only key for a write               | 403               |
| unknown model                                                     | 404               |
| body over the limit                                               | 413               |
| rejected: ``quota_exceeded``, ``region_throttled``                | 429, rate headers |
| rejected: breaker open, overloaded, quota store down; error:      | 503, Retry-After  |
| worker shutdown; ingress's own Redis or Kafka down                |                   |
| error: engine error, undeliverable reply, ``stream_interrupted``  | 502               |
| expired, or no terminal reply by the deadline (+ margin)          | 504               |
| ok; degraded (with ``X-Seawall-Degraded: <reason>``)              | 200               |

"Rate headers": ``X-RateLimit-Limit``, ``X-RateLimit-Remaining``, ``X-RateLimit-Reset``
(seconds until the bucket is full) and ``Retry-After`` (whole seconds, at least 1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas import (
    ChatMessage,
    ClientMeta,
    InferenceReply,
    InferenceRequest,
    RateLimitInfo,
    ReasonCode,
    ReplyStatus,
    SamplingParams,
)
from seawall_client.serde import describe
from services.common.openai_shapes import (
    OneChoice,
    OnePrompt,
    TextPart,
    chunk_object,
    completion_id,
    content_text,
    envelope,
    usage,
)
from services.ingress.refusals import Refusal, invalid, param_of

# --- request bodies ------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Body(OneChoice):
    """What both endpoints share. Sampling values are checked by ``SamplingParams``
    (whose field names are OpenAI's), so the bounds live in one place."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    stop: str | list[str] | None = None
    seed: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """OpenAI's end-user id: the session key unless ``X-Session-Id`` is given."""
    timeout: float | None = Field(default=None, gt=0, le=86_400, allow_inf_nan=False)

    def sampling(self) -> dict[str, Any]:
        values = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": (self.stop,) if isinstance(self.stop, str) else self.stop,
            "seed": self.seed,
        }
        return {k: v for k, v in values.items() if v is not None}


class CompletionBody(_Body, OnePrompt):
    pass


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def to_wire(self) -> dict[str, str]:
        """``developer`` is OpenAI's newer name for ``system``."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content_text(self.content)}


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Any = None

    def sampling(self) -> dict[str, Any]:
        values = super().sampling()
        if self.max_completion_tokens is not None:
            values["max_tokens"] = self.max_completion_tokens
        return values


Body = CompletionBody | ChatBody
B = TypeVar("B", CompletionBody, ChatBody)


def parse_body(raw: bytes, model: type[B]) -> B | Refusal:
    """Strict UTF-8, then JSON, then the body model; each failure its own code (the
    same codes as dead letters: ``invalid_utf8``, ``invalid_json``, ``schema_violation``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return invalid("invalid_utf8", f"The body is not UTF-8 (at byte {e.start}).")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return invalid(
            "invalid_json", f"The body is not JSON: {e.msg} at line {e.lineno} column {e.colno}."
        )
    except (ValueError, RecursionError):  # digits beyond Python's limit; absurd nesting
        return invalid("invalid_json", "The body is not JSON that can be read.")
    if not isinstance(data, dict):
        return invalid("schema_violation", "The body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        return invalid("schema_violation", describe(e), param_of(e))


def to_request(
    body: Body,
    *,
    request_id: str,
    tenant: str,
    model: str,
    reply_to: str,
    created_at: float,
    timeout_s: float | None,
    session_id: str | None,
    client: ClientMeta,
) -> InferenceRequest | Refusal:
    """The draft request (tenant, tier, pool and final deadline are the pipeline's)."""
    timeouts = [t for t in (timeout_s, body.timeout) if t is not None]
    try:
        sampling = SamplingParams.model_validate(body.sampling())
        return InferenceRequest(
            request_id=request_id,
            tenant=tenant,
            model=model,
            prompt=body.text() if isinstance(body, CompletionBody) else None,
            messages=(
                tuple(ChatMessage.model_validate(m.to_wire()) for m in body.messages)
                if isinstance(body, ChatBody)
                else None
            ),
            sampling=sampling,
            stream=body.stream,
            reply_to=reply_to,
            created_at=created_at,
            deadline_at=created_at + min(timeouts) if timeouts else None,
            session_id=session_id,
            client=client,
        )
    except ValidationError as e:
        return invalid("schema_violation", describe(e), _openai_param(param_of(e)))


def _openai_param(param: str | None) -> str | None:
    """``sampling.max_tokens`` is ``max_tokens`` to an OpenAI client."""
    if param is not None and param.startswith("sampling."):
        return param.removeprefix("sampling.")
    return param


# --- errors --------------------------------------------------------------------------

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
}


@dataclass(frozen=True, slots=True)
class ApiError:
    status: int
    code: str
    message: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


_REFUSAL_STATUS = {
    ReasonCode.INVALID_REQUEST: 400,
    ReasonCode.SENSITIVE_DATA: 400,
    ReasonCode.UNAUTHENTICATED: 401,
    ReasonCode.FORBIDDEN: 403,
    ReasonCode.QUOTA_EXCEEDED: 429,
}
_CODE_STATUS = {"body_too_large": 413, "model_not_found": 404, "too_many_failures": 429}


def error_for_refusal(refusal: Refusal) -> ApiError:
    status = _CODE_STATUS.get(refusal.code) or _REFUSAL_STATUS.get(refusal.reason, 400)
    headers = rate_limit_headers(refusal.rate_limit)
    if refusal.retry_after_s is not None:
        headers |= retry_after(refusal.retry_after_s)
    return ApiError(status, refusal.code, refusal.message, refusal.param, headers)


_REJECTED_STATUS = {
    ReasonCode.QUOTA_EXCEEDED: 429,
    ReasonCode.REGION_THROTTLED: 429,
    ReasonCode.BREAKER_OPEN: 503,
    ReasonCode.OVERLOADED: 503,
    ReasonCode.QUOTA_UNAVAILABLE: 503,
    ReasonCode.WORKER_SHUTDOWN: 503,
    ReasonCode.INVALID_REQUEST: 400,
    ReasonCode.SENSITIVE_DATA: 400,
    ReasonCode.UNAUTHENTICATED: 401,
    ReasonCode.FORBIDDEN: 403,
    ReasonCode.DEADLINE_EXCEEDED: 504,
    ReasonCode.CANCELLED: 499,
}
_ERROR_STATUS = {ReasonCode.WORKER_SHUTDOWN: 503, ReasonCode.INVALID_REQUEST: 400}
"""An ``error`` for ``invalid_request``: the engine refused the request (a prompt longer
than its context, say); anything else that failed is the fleet's (502)."""


def retry_after(seconds: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds, at least one."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def rate_limit_headers(info: RateLimitInfo | None) -> dict[str, str]:
    if info is None:
        return {}
    return {
        "X-RateLimit-Limit": str(info.limit),
        "X-RateLimit-Remaining": str(info.remaining),
        "X-RateLimit-Reset": str(math.ceil(info.reset_s)),
    }


def error_for_reply(reply: InferenceReply, default_retry_after_s: float) -> ApiError | None:
    """The error a terminal reply means over HTTP; ``None`` for ok and degraded."""
    if reply.status in (ReplyStatus.OK, ReplyStatus.DEGRADED):
        return None
    if reply.status is ReplyStatus.EXPIRED:
        status = 504
    elif reply.status is ReplyStatus.REJECTED:
        status = _REJECTED_STATUS.get(reply.reason, 503)
    else:
        status = _ERROR_STATUS.get(reply.reason, 502)
    headers = rate_limit_headers(reply.rate_limit)
    if status in (429, 503):
        retry = reply.rate_limit.retry_after_s if reply.rate_limit else default_retry_after_s
        headers |= retry_after(retry)
    code = reply.code or (
        reply.reason.value if reply.reason is not ReasonCode.NONE else reply.status.value
    )
    message = reply.message or f"The request was {reply.status.value} ({code})."
    return ApiError(status, code, message, None, headers)


def success_headers(reply: InferenceReply) -> dict[str, str]:
    headers = rate_limit_headers(reply.rate_limit)
    if reply.status is ReplyStatus.DEGRADED:
        headers["X-Seawall-Degraded"] = reply.reason.value
    return headers


# --- responses -----------------------------------------------------------------------


def _finish_reason(reply: InferenceReply) -> str:
    return "length" if reply.finish_reason == "length" else "stop"


def usage_of(reply: InferenceReply) -> dict[str, int]:
    return usage(reply.prompt_tokens, reply.completion_tokens)


@dataclass(frozen=True, slots=True)
class Shape:
    """How one request's answer is shaped: chat or completion, id, model, time."""

    chat: bool
    request_id: str
    model: str
    created: int
    include_usage: bool = False

    @property
    def id(self) -> str:
        return completion_id(self.chat, self.request_id)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return envelope(self.id, obj, self.created, self.model, choices)

    def response(self, reply: InferenceReply) -> dict[str, Any]:
        """The whole answer of a non-streamed request."""
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": _finish_reason(reply),
        }
        if self.chat:
            choice["message"] = {"role": "assistant", "content": reply.text}
            obj = "chat.completion"
        else:
            choice["text"] = reply.text
            obj = "text_completion"
        return {**self._envelope(obj, [choice]), "usage": usage_of(reply)}

    @property
    def _chunk_object(self) -> str:
        return chunk_object(self.chat)

    def opening_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        if not self.chat:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return self._envelope(self._chunk_object, [choice])

    def chunk(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        return self._envelope(self._chunk_object, [choice])

    def final_chunk(self, reply: InferenceReply) -> dict[str, Any]:
        """The last content chunk: the finish reason, and a degraded reply's reason
        (a stream's headers are sent before it is known)."""
        chunk = self.chunk("", _finish_reason(reply))
        if reply.status is ReplyStatus.DEGRADED:
            chunk["seawall"] = {"degraded": reply.reason.value}
        return chunk

    def usage_chunk(self, reply: InferenceReply) -> dict[str, Any]:
        return {**self._envelope(self._chunk_object, []), "usage": usage_of(reply)}


def models_list(models: list[str]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": m, "object": "model", "created": 0, "owned_by": "seawall"} for m in models],
    }
