"""Why a request may not go on: a ``Refusal`` — a ``ReasonCode`` for the wire, a stable
``code`` and a message that never echoes the input — and the common ones. HTTP turns a
refusal into an OpenAI error, Kafka into a terminal ``rejected`` reply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import ValidationError

from schemas import QuotaHint, RateLimitInfo, ReasonCode


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: ReasonCode
    code: str
    """Stable and specific: ``body_too_large``, ``invalid_api_key``, ``key_revoked``, ..."""
    message: str
    """For the client; never carries the inspected input."""
    param: str | None = None
    """The offending request field, where there is one."""
    retry_after_s: float | None = None
    """When trying again may succeed (HTTP ``Retry-After``), where that is known."""
    rate_limit: RateLimitInfo | None = None
    """The quota figures behind a ``quota_exceeded`` refusal (``X-RateLimit-*``)."""


def over_quota(hint: QuotaHint, now: float) -> Refusal:
    """The refusal a quota hint makes: what admission would answer, with the figures
    of the rejection behind the hint as they stand at ``now``."""
    wait_s = max(1, math.ceil(hint.until - now))
    info = hint.rate_limit
    reset_s = min(86_400.0, max(0.0, info.reset_s - (now - hint.issued_at)))
    return Refusal(
        ReasonCode.QUOTA_EXCEEDED,
        ReasonCode.QUOTA_EXCEEDED.value,
        "quota exceeded",
        retry_after_s=wait_s,
        rate_limit=RateLimitInfo(
            limit=info.limit, remaining=0, reset_s=reset_s, retry_after_s=wait_s
        ),
    )


def invalid(code: str, message: str, param: str | None = None) -> Refusal:
    return Refusal(ReasonCode.INVALID_REQUEST, code, message, param)


def body_too_large(limit: int) -> Refusal:
    return invalid("body_too_large", f"The request is larger than {limit} bytes.")


def param_of(error: ValidationError) -> str | None:
    """The first offending field as a dotted path (``messages.0.content``)."""
    errors = error.errors(include_url=False, include_input=False)
    if not errors or not errors[0]["loc"]:
        return None
    return ".".join(str(p) for p in errors[0]["loc"])
