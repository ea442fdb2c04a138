"""The table of quota hints ingress refuses by."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import QuotaHint, RateLimitInfo
from services.ingress.policy.hints import QuotaHints

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0
INFO = RateLimitInfo(limit=20, remaining=0, reset_s=20.0, retry_after_s=1.0)


def hint(tenant: str, until: float) -> QuotaHint:
    return QuotaHint(tenant=tenant, until=until, issued_at=T0, rate_limit=INFO)


def test_a_hint_covers_its_tenant_until_it_passes() -> None:
    hints = QuotaHints()
    hints.observe(hint("a", T0 + 1), T0)
    assert hints.covering("a", T0 + 0.999) is not None
    assert hints.covering("b", T0) is None
    assert hints.covering("a", T0 + 1) is None
    assert len(hints) == 0  # a hint that passed is dropped when met


def test_a_later_hint_extends_and_an_earlier_one_does_not_shorten() -> None:
    hints = QuotaHints()
    hints.observe(hint("a", T0 + 2), T0)
    hints.observe(hint("a", T0 + 1), T0)  # read out of order: kept the longer
    assert hints.covering("a", T0 + 1.5) is not None
    hints.observe(hint("a", T0 + 3), T0)
    assert hints.covering("a", T0 + 2.5) is not None
    hints.observe(hint("a", T0 + 1), T0 + 2)  # already passed when read
    assert hints.covering("a", T0 + 2.9) is not None


def test_zero_tenants_turns_hints_off() -> None:
    hints = QuotaHints(max_tenants=0)
    hints.observe(hint("a", T0 + 1), T0)
    assert hints.covering("a", T0) is None


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.integers(0, 30), st.floats(0.0, 5.0), st.floats(0.0, 0.5)), max_size=200
    )
)
def test_the_table_stays_bounded_and_never_covers_past_a_hints_until(
    events: list[tuple[int, float, float]],
) -> None:
    hints = QuotaHints(max_tenants=8)
    latest: dict[str, float] = {}
    now = T0
    for tenant_no, length, step in events:
        now += step
        tenant = f"t{tenant_no}"
        hints.observe(hint(tenant, now + length), now)
        latest[tenant] = max(latest.get(tenant, 0.0), now + length)
        assert len(hints) <= 8
        for t, until in latest.items():
            covered = hints.covering(t, now)
            if covered is not None:
                assert now < covered.until <= until


def test_a_hint_covers_at_most_max_hint_s_from_when_it_is_read() -> None:
    """A hint that says "for a day" (forged, or a tier refilling once a day) covers a
    minute; then admission is asked again."""
    hints = QuotaHints(max_hint_s=60.0)
    hints.observe(hint("a", T0 + 86_400), T0)
    assert hints.covering("a", T0 + 59.9) is not None
    assert hints.covering("a", T0 + 60.0) is None


def clear(tenant: str, at: float) -> QuotaHint:
    return QuotaHint(tenant=tenant, until=at, issued_at=at, rate_limit=INFO)


def test_a_clear_drops_the_hints_issued_before_it_not_after() -> None:
    """The tenant's quota changed: a hint issued before that may no longer hold; one
    issued after (read out of order) still does."""
    hints = QuotaHints()
    hints.observe(hint("a", T0 + 30), T0)  # issued at T0
    hints.observe(clear("a", T0 + 1), T0 + 1)
    assert hints.covering("a", T0 + 1) is None
    later = hint("a", T0 + 30).model_copy(update={"issued_at": T0 + 2})
    hints.observe(later, T0 + 2)
    hints.observe(clear("a", T0 + 1), T0 + 2)  # an older clear, read late
    assert hints.covering("a", T0 + 2) is not None
