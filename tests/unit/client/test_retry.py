"""The SDK's retry policy: which replies are retried, how long it waits, how often."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import InferenceReply, RateLimitInfo, ReasonCode, ReplyStatus
from seawall_client.retry import (
    RETRYABLE_ERRORS,
    RETRYABLE_REJECTIONS,
    RetryBudget,
    RetryPolicy,
    attempt_id,
    attempt_of,
    retry_after_s,
    retryable,
)


def reply(
    status: ReplyStatus, reason: ReasonCode, retry_after: float | None = None
) -> InferenceReply:
    info = (
        None
        if retry_after is None
        else RateLimitInfo(limit=10, remaining=0, reset_s=5, retry_after_s=retry_after)
    )
    return InferenceReply(
        request_id="r", status=status, reason=reason, rate_limit=info, completed_at=time.time()
    )


@pytest.mark.parametrize("status", list(ReplyStatus))
@pytest.mark.parametrize("reason", list(ReasonCode))
def test_only_not_now_answers_are_retried(status: ReplyStatus, reason: ReasonCode) -> None:
    expected = (status is ReplyStatus.REJECTED and reason in RETRYABLE_REJECTIONS) or (
        status is ReplyStatus.ERROR and reason in RETRYABLE_ERRORS
    )
    assert retryable(reply(status, reason)) is expected


def test_the_answers_that_say_not_now() -> None:
    assert retryable(reply(ReplyStatus.REJECTED, ReasonCode.OVERLOADED))
    assert retryable(reply(ReplyStatus.REJECTED, ReasonCode.QUOTA_EXCEEDED, 2.0))
    assert retryable(reply(ReplyStatus.ERROR, ReasonCode.WORKER_SHUTDOWN))
    assert not retryable(reply(ReplyStatus.REJECTED, ReasonCode.SENSITIVE_DATA))
    assert not retryable(reply(ReplyStatus.ERROR, ReasonCode.ENGINE_ERROR))
    assert not retryable(reply(ReplyStatus.EXPIRED, ReasonCode.DEADLINE_EXCEEDED))
    assert not retryable(reply(ReplyStatus.OK, ReasonCode.NONE))


def test_retry_after_comes_from_the_rate_limit_figures() -> None:
    assert retry_after_s(reply(ReplyStatus.REJECTED, ReasonCode.QUOTA_EXCEEDED, 3.5)) == 3.5
    assert retry_after_s(reply(ReplyStatus.REJECTED, ReasonCode.OVERLOADED)) == 0.0


@given(
    failed=st.integers(min_value=1, max_value=200),
    retry_after=st.floats(min_value=0, max_value=3600),
    base=st.floats(min_value=0, max_value=5),
    extra_cap=st.floats(min_value=0, max_value=60),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_backoff_is_retry_after_plus_full_jitter_under_the_cap(
    failed: int, retry_after: float, base: float, extra_cap: float, seed: int
) -> None:
    policy = RetryPolicy(base_s=base, cap_s=base + extra_cap)
    wait = policy.backoff_s(failed, retry_after, random.Random(seed))
    ceiling = min(policy.cap_s, base * 2 ** (failed - 1))
    assert retry_after <= wait <= retry_after + ceiling


def test_backoff_spreads_over_the_whole_window_and_doubles() -> None:
    policy = RetryPolicy(base_s=1.0, cap_s=100.0)
    rng = random.Random(7)
    for failed, ceiling in ((1, 1.0), (2, 2.0), (3, 4.0), (8, 100.0)):
        waits = [policy.backoff_s(failed, 0.0, rng) for _ in range(2000)]
        assert max(waits) <= ceiling
        # Full jitter: uniform over [0, ceiling], not clustered at the top.
        assert min(waits) < 0.05 * ceiling
        assert max(waits) > 0.95 * ceiling
        assert 0.45 * ceiling < sum(waits) / len(waits) < 0.55 * ceiling


@pytest.mark.parametrize(
    "bad",
    [
        {"max_attempts": 0},
        {"base_s": 2.0, "cap_s": 1.0},
        {"base_s": -1.0},
        {"budget_ratio": -0.1},
        {"reserve_per_s": -1.0},
    ],
)
def test_nonsense_policies_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"must be|need|negative"):
        RetryPolicy(**bad)  # type: ignore[arg-type]


@given(
    requests=st.integers(min_value=0, max_value=2000),
    ratio=st.floats(min_value=0, max_value=1),
    reserve=st.integers(min_value=0, max_value=50),
)
def test_retries_stay_a_bounded_fraction_of_requests(
    requests: int, ratio: float, reserve: int
) -> None:
    """Every request fails and wants a retry at one instant: the budget grants at most the
    reserve plus what the requests earned."""
    budget = RetryBudget(RetryPolicy(budget_ratio=ratio, budget_reserve=reserve))
    granted = 0
    for _ in range(requests):
        budget.deposit()
        granted += budget.withdraw(now=0.0)
    assert granted <= reserve + ratio * requests + 1e-9
    # ... and no less than the reserve when there were requests enough to ask.
    assert granted >= min(requests, reserve)


def test_the_reserve_refills_with_time_up_to_its_size() -> None:
    budget = RetryBudget(RetryPolicy(budget_ratio=0.0, budget_reserve=3, reserve_per_s=0.5))
    assert [budget.withdraw(0.0) for _ in range(4)] == [True, True, True, False]
    assert not budget.withdraw(1.0)  # 0.5/s: half a retry after one second
    assert budget.withdraw(2.0)
    assert not budget.withdraw(2.0)
    # A long pause refills only up to the reserve.
    assert [budget.withdraw(1000.0) for _ in range(4)] == [True, True, True, False]


def test_earned_retries_are_capped() -> None:
    budget = RetryBudget(RetryPolicy(budget_ratio=1.0, budget_reserve=2, reserve_per_s=0.0))
    for _ in range(100):
        budget.deposit()
    assert sum(budget.withdraw(0.0) for _ in range(10)) == 4  # 2 earned + 2 reserve


def test_attempt_ids_read_back() -> None:
    assert [attempt_id("load-ab-3", n) for n in (1, 2, 12)] == [
        "load-ab-3",
        "load-ab-3.2",
        "load-ab-3.12",
    ]
    assert attempt_of("load-ab-3", "load-ab-3") == 1
    assert attempt_of("load-ab-3", "load-ab-3.2") == 2
    assert attempt_of("load-ab-3", "load-ab-3.12") == 12
    assert attempt_of("load-ab-3", "other") == 1


@given(st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True), st.integers(1, 100))
def test_attempt_of_inverts_attempt_id(request_id: str, attempt: int) -> None:
    assert attempt_of(request_id, attempt_id(request_id, attempt)) == attempt
