"""What admission's decisions return — a terminal reply, or the request's next step
(screened, accepted, admitted) — and the replies they build (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from schemas import (
    DispatchedRequest,
    InferenceReply,
    InferenceRequest,
    Priority,
    RateLimitInfo,
    ReasonCode,
    ReplyStatus,
)
from services.admission.policy.charges import QuotaRequest
from services.admission.policy.cost import NO_COST, Cost

_WIRE_MAX_SECONDS = 86_400


@dataclass(frozen=True, slots=True)
class Reply:
    """A terminal reply instead of a dispatch."""

    reply: InferenceReply


@dataclass(frozen=True, slots=True)
class Screened:
    """Passed the free checks; these quota charges decide the rest."""

    pool: str
    """The pool asked for (the enterprise pool for the enterprise tier)."""
    tenant: QuotaRequest
    region: QuotaRequest | None = None
    prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Accepted:
    """Within quota; waits in ``cls``'s backlog for a dispatch slot."""

    pool: str
    cls: Priority
    quota_degraded: bool
    reserved_tokens: float
    """Tokens charged to the tenant's bucket, to correct at completion (0: none)."""
    cost: Cost = NO_COST
    """What it will occupy on a worker (the pacing rule's units)."""
    refusal: RateLimitInfo | None = None
    """Set for an over-quota request in the scavenger lane: the refusal it was spared,
    which it gets after all if no idle capacity comes in time (its 429 headers)."""

    @property
    def scavenger(self) -> bool:
        return self.refusal is not None


@dataclass(frozen=True, slots=True)
class Admit:
    dispatch: DispatchedRequest
    reason: ReasonCode
    """What admission changed (``none``: nothing)."""


def retry_only(seconds: float) -> RateLimitInfo:
    """Rate-limit fields of a rejection no quota figure applies to: only the retry hint."""
    s = min(float(max(1, math.ceil(seconds))), _WIRE_MAX_SECONDS)
    return RateLimitInfo(limit=0, remaining=0, reset_s=s, retry_after_s=s)


def terminal(
    request: InferenceRequest,
    status: ReplyStatus,
    reason: ReasonCode,
    message: str,
    now: float,
    rate_limit: RateLimitInfo | None = None,
    code: str | None = None,
) -> Reply:
    return Reply(
        InferenceReply(
            request_id=request.request_id,
            status=status,
            reason=reason,
            code=code,
            message=message,
            rate_limit=rate_limit,
            completed_at=now,
        )
    )


def failed(request: InferenceRequest, code: str, message: str, now: float) -> Reply:
    """The reply to a request whose processing failed on its own account (it cannot be
    dispatched: too large to forward, say); ``code`` and ``message`` never echo it."""
    return terminal(
        request, ReplyStatus.ERROR, ReasonCode.INVALID_REQUEST, message, now, None, code
    )
