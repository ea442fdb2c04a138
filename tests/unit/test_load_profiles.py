"""``seawall load``'s traffic plans: arrival times, burst shape, prompt and tenant mixes."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import Tier
from seawall.load.profiles import (
    DEFAULT_MIX,
    PROFILES,
    Profile,
    PromptMix,
    Segment,
    arrival_times,
    expected_arrivals,
    parse_mix,
    plan,
    prompt_text,
    segments,
    spread_tenants,
)
from services.common.tokenizer import count_tokens

pytestmark = pytest.mark.unit

rates = st.floats(min_value=0.5, max_value=50)
durations = st.floats(min_value=1, max_value=600)


# Many draws per example: no per-example deadline on a busy machine.
@settings(deadline=None)
@given(rates, durations, st.sampled_from(PROFILES), st.integers(0, 2**32))
def test_arrivals_ascend_within_the_run(
    rate: float, duration: float, profile: Profile, seed: int
) -> None:
    segs = segments(profile, rate, duration)
    times = arrival_times(segs, random.Random(seed))
    assert times == sorted(times)
    assert all(0 <= t < duration for t in times)


@given(rates, durations, st.sampled_from(PROFILES))
def test_segments_tile_the_run(rate: float, duration: float, profile: Profile) -> None:
    segs = segments(profile, rate, duration)
    assert segs[0].start_s == 0
    assert segs[-1].end_s == duration
    assert all(a.end_s == b.start_s for a, b in itertools.pairwise(segs))


def test_burst_is_five_times_the_base_rate_in_the_middle_third() -> None:
    assert segments("burst", 2.0, 90.0) == (
        Segment(0.0, 30.0, 2.0),
        Segment(30.0, 60.0, 10.0),
        Segment(60.0, 90.0, 2.0),
    )
    assert expected_arrivals(segments("burst", 2.0, 90.0)) == pytest.approx(2.0 * 90 * 7 / 3)
    assert expected_arrivals(segments("steady", 2.0, 90.0)) == pytest.approx(180.0)


@pytest.mark.parametrize(
    ("profile", "rate", "duration"), [("steady", 20.0, 500.0), ("burst", 10.0, 600.0)]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arrival_counts_match_rate_times_duration(
    profile: Profile, rate: float, duration: float, seed: int
) -> None:
    """A Poisson count has variance equal to its mean: within 4 standard deviations."""
    segs = segments(profile, rate, duration)
    times = arrival_times(segs, random.Random(seed))
    for seg in segs:
        n = sum(1 for t in times if seg.start_s <= t < seg.end_s)
        mean = seg.rate * (seg.end_s - seg.start_s)
        assert abs(n - mean) < 4 * math.sqrt(mean), (seg, n)


def test_inter_arrival_times_are_exponential() -> None:
    """Mean and coefficient of variation 1/rate and 1 (a Poisson process, not a clock)."""
    times = arrival_times(segments("steady", 10.0, 2000.0), random.Random(7))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1))
    assert mean == pytest.approx(0.1, rel=0.03)
    assert sd / mean == pytest.approx(1.0, rel=0.05)


def test_the_same_seed_gives_the_same_plan() -> None:
    segs = segments("burst", 5.0, 30.0)
    a = plan(segs, 4, PromptMix(), random.Random(3))
    assert a == plan(segs, 4, PromptMix(), random.Random(3))
    assert a != plan(segs, 4, PromptMix(), random.Random(4))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_rates_and_durations_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="rate"):
        segments("steady", bad, 10.0)
    with pytest.raises(ValueError, match="duration"):
        segments("steady", 1.0, bad)
    with pytest.raises(ValueError, match="multiplier"):
        segments("burst", 1.0, 10.0, bad)


# Many draws per example: no per-example deadline on a busy machine.
@settings(deadline=None)
@given(st.floats(0, 1), st.integers(0, 2**32))
def test_prompts_are_short_or_long_in_their_ranges(long_fraction: float, seed: int) -> None:
    mix = PromptMix(long_fraction=long_fraction, short_words=(2, 5), long_words=(50, 60))
    for request in plan(segments("steady", 50.0, 2.0), 3, mix, random.Random(seed)):
        lo, hi = mix.long_words if request.long else mix.short_words
        assert lo <= request.words <= hi
        assert 0 <= request.tenant < 3
        assert count_tokens(prompt_text(request)) == request.words


def test_the_long_fraction_is_the_share_of_long_prompts() -> None:
    requests = plan(segments("steady", 100.0, 100.0), 1, PromptMix(0.3), random.Random(1))
    share = sum(r.long for r in requests) / len(requests)
    assert share == pytest.approx(0.3, abs=0.02)
    assert not any(
        r.long for r in plan(segments("steady", 100.0, 10.0), 1, PromptMix(0.0), random.Random(1))
    )


def test_the_longest_prompt_fits_the_ingress_record_limit() -> None:
    longest = plan(
        segments("steady", 1.0, 1.0), 1, PromptMix(1.0, long_words=(2048, 2048)), random.Random(0)
    )
    assert all(len(prompt_text(r).encode()) < 16 * 1024 for r in longest)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"long_fraction": 1.5},
        {"long_fraction": -0.1},
        {"short_words": (0, 3)},
        {"long_words": (9, 3)},
    ],
)
def test_prompt_mix_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"fraction|range"):
        PromptMix(**kwargs)


def test_parse_mix_normalises_weights() -> None:
    assert parse_mix("basic=5,pro=3,enterprise=2") == {
        Tier.BASIC: 0.5,
        Tier.PRO: 0.3,
        Tier.ENTERPRISE: 0.2,
    }
    assert parse_mix("enterprise=1") == {Tier.BASIC: 0.0, Tier.PRO: 0.0, Tier.ENTERPRISE: 1.0}


@pytest.mark.parametrize(
    "bad", ["", "gold=1", "basic", "basic=x", "basic=-1", "basic=0", "pro=inf"]
)
def test_parse_mix_refuses_nonsense(bad: str) -> None:
    with pytest.raises(ValueError, match=r"tier|weight"):
        parse_mix(bad)


mixes = st.fixed_dictionaries({tier: st.floats(0, 10) for tier in Tier}).filter(
    lambda m: sum(m.values()) > 0.01
)


@given(st.integers(1, 200), mixes)
def test_tenants_are_spread_by_the_mix(n: int, mix: dict[Tier, float]) -> None:
    tenants = spread_tenants(n, mix)
    assert len(tenants) == n
    assert len({t.name for t in tenants}) == n
    total = sum(mix.values())
    for tier in Tier:
        count = sum(1 for t in tenants if t.tier is tier)
        assert abs(count - n * mix[tier] / total) < 1
        if mix[tier] == 0:
            assert count == 0


def test_tenant_names_are_stable_across_runs() -> None:
    assert [(t.name, t.tier) for t in spread_tenants(4, DEFAULT_MIX, "ci")] == [
        ("ci-basic-0", Tier.BASIC),
        ("ci-basic-1", Tier.BASIC),
        ("ci-pro-0", Tier.PRO),
        ("ci-enterprise-0", Tier.ENTERPRISE),
    ]
    with pytest.raises(ValueError, match="tenant"):
        spread_tenants(0, DEFAULT_MIX)
