"""When the client SDK retries a rejected request, and how long it waits: pure, no I/O.

- **What is retried**: rejections that say "not now" — overload, an open breaker, the
  quota store or a worker going away, a quota or region limit with its ``Retry-After``.
  Not: invalid or refused requests (they would fail again), engine errors (the work may
  have been done), expiry (the deadline is gone).
- **How long**: exponential backoff with full jitter (a uniform draw in
  ``[0, min(cap, base·2^(n-1))]`` after the n-th failed attempt), added on top of the
  server's ``Retry-After``: the server's figure is a floor, and the jitter keeps the
  clients it told the same figure from all coming back in the same instant.
- **How often**: a retry budget (as Finagle's): every request deposits ``ratio`` of a
  retry, a retry withdraws one, and a reserve that refills at ``reserve_per_s`` lets
  a quiet client retry at all. When the fleet rejects most requests the retries stay a
  bounded fraction of the traffic instead of multiplying it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from schemas import InferenceReply, ReasonCode, ReplyStatus

RETRYABLE_REJECTIONS: frozenset[ReasonCode] = frozenset(
    {
        ReasonCode.OVERLOADED,
        ReasonCode.BREAKER_OPEN,
        ReasonCode.QUOTA_UNAVAILABLE,
        ReasonCode.QUOTA_EXCEEDED,
        ReasonCode.REGION_THROTTLED,
        ReasonCode.WORKER_SHUTDOWN,
    }
)
#: Errors after which the request never ran to completion anywhere.
RETRYABLE_ERRORS: frozenset[ReasonCode] = frozenset({ReasonCode.WORKER_SHUTDOWN})


def attempt_id(request_id: str, attempt: int) -> str:
    """The id attempt ``attempt`` is sent with: the request's own, then ``<id>.<n>`` (a
    new id per retry, so that a late copy of an earlier attempt's rejection is never
    taken for the retry's answer)."""
    return request_id if attempt == 1 else f"{request_id}.{attempt}"


def attempt_of(request_id: str, reply_id: str) -> int:
    """The attempt a reply answers (``attempt_id`` read back); 1 for a foreign id."""
    suffix = reply_id.removeprefix(f"{request_id}.")
    return int(suffix) if reply_id != request_id and suffix.isdigit() else 1


def retryable(reply: InferenceReply) -> bool:
    if reply.status is ReplyStatus.REJECTED:
        return reply.reason in RETRYABLE_REJECTIONS
    if reply.status is ReplyStatus.ERROR:
        return reply.reason in RETRYABLE_ERRORS
    return False


def retry_after_s(reply: InferenceReply) -> float:
    """The server's ``Retry-After`` for this reply, 0 where it gave none."""
    return reply.rate_limit.retry_after_s if reply.rate_limit is not None else 0.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 4
    """Attempts in all, the first included; 1 turns retries off."""
    base_s: float = 0.2
    cap_s: float = 10.0
    budget_ratio: float = 0.2
    """Retries earned per request sent."""
    budget_reserve: float = 10.0
    """Retries available to a client that has sent little; refilled at ``reserve_per_s``."""
    reserve_per_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not 0 <= self.base_s <= self.cap_s:
            raise ValueError("need 0 <= base_s <= cap_s")
        if self.budget_ratio < 0 or self.budget_reserve < 0 or self.reserve_per_s < 0:
            raise ValueError("the retry budget's figures cannot be negative")

    def backoff_s(self, failed_attempts: int, retry_after: float, rng: random.Random) -> float:
        """The wait before the next attempt, after ``failed_attempts`` (>= 1) failures."""
        ceiling = min(self.cap_s, self.base_s * 2 ** min(failed_attempts - 1, 62))
        return max(0.0, retry_after) + rng.uniform(0.0, ceiling)


@dataclass(slots=True)
class RetryBudget:
    """Tokens of retry: ``deposit`` per request, ``withdraw`` per retry (``now`` in seconds
    on any monotonic clock)."""

    policy: RetryPolicy
    earned: float = 0.0
    reserve: float = field(init=False)
    _last: float | None = None

    def __post_init__(self) -> None:
        self.reserve = self.policy.budget_reserve

    def deposit(self) -> None:
        # Earned retries are capped like the reserve: a long quiet success streak does
        # not bank an unbounded burst of retries for later.
        self.earned = min(self.earned + self.policy.budget_ratio, self.policy.budget_reserve)

    def withdraw(self, now: float) -> bool:
        """Take one retry if the budget has it."""
        if self._last is not None:
            refill = (now - self._last) * self.policy.reserve_per_s
            self.reserve = min(self.policy.budget_reserve, self.reserve + max(0.0, refill))
        self._last = now
        if self.earned >= 1.0:
            self.earned -= 1.0
            return True
        if self.reserve >= 1.0:
            self.reserve -= 1.0
            return True
        return False
