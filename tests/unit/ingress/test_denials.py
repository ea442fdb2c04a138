"""The failure limiter behind ingress's audit of denials and its per-address refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.ingress.denials import FailureLimiter

pytestmark = pytest.mark.unit


def test_a_subject_fails_its_burst_then_one_per_refill_and_skips_are_counted() -> None:
    limiter = FailureLimiter(rate_per_s=0.5, burst=3)
    assert [limiter.fail("k", 0.0) for _ in range(3)] == [(True, 0)] * 3
    assert limiter.fail("k", 0.0) == (False, 0)
    assert limiter.fail("k", 1.0) == (False, 0)
    assert limiter.exhausted("k", 1.0) == pytest.approx(1.0)
    assert limiter.fail("k", 2.0) == (True, 2)  # two left out since the last one within
    assert limiter.exhausted("other", 2.0) == 0.0  # subjects are apart


def test_subjects_beyond_the_limit_are_forgotten_oldest_first() -> None:
    limiter = FailureLimiter(rate_per_s=0.001, burst=1, max_subjects=2)
    for s in ("a", "b", "c"):
        limiter.fail(s, 0.0)
    assert limiter.exhausted("a", 0.0) == 0.0  # forgotten: a full bucket again
    assert limiter.exhausted("c", 0.0) > 0


@given(st.lists(st.floats(0, 0.5), min_size=1, max_size=200))
def test_never_more_within_budget_than_burst_plus_refill(gaps: list[float]) -> None:
    limiter = FailureLimiter(rate_per_s=2.0, burst=5)
    now, within = 0.0, 0
    for gap in gaps:
        now += gap
        within += limiter.fail("k", now)[0]
    assert within <= 5 + 2.0 * now + 1e-9


def test_nonsense_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="rate_per_s"):
        FailureLimiter(rate_per_s=0, burst=1)
