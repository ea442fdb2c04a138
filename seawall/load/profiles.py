"""What ``seawall load`` sends and when, pure: the rng is injected, nothing is sent here.

Arrivals are open-loop (they never wait for replies): a Poisson process whose rate is
piecewise constant over the run.

- ``steady``: ``rate`` requests per second throughout.
- ``burst``: ``rate`` in the first and last thirds, ``burst_multiplier × rate`` (5× by
  default) in the middle third, so a run sends about ``(2 + multiplier) / 3 × rate ×
  duration`` requests (7/3 × rate × duration at 5×).

Within each constant-rate segment inter-arrival times are exponential; the process is
memoryless, so restarting the draw at a segment boundary is exact.

Each request goes to one tenant drawn uniformly, so a tier's share of the traffic is its
share of the tenants; tenants are spread over the tiers by the mix (largest remainder).
Prompts are short or, with probability ``long_fraction``, long; their lengths are drawn
uniformly from the range of their kind, in words of at most five letters (one token
each for seawall's token counter).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from schemas import Tier

Profile = Literal["steady", "burst"]
PROFILES: tuple[Profile, ...] = ("steady", "burst")
BURST_MULTIPLIER = 5.0
DEFAULT_MIX: Mapping[Tier, float] = {Tier.BASIC: 0.5, Tier.PRO: 0.3, Tier.ENTERPRISE: 0.2}
_VOCAB = ("alpha", "bravo", "delta", "echo", "gulf", "hotel", "kilo", "lima", "mike", "oscar")


@dataclass(frozen=True, slots=True)
class Segment:
    """``rate`` arrivals per second over ``[start_s, end_s)``."""

    start_s: float
    end_s: float
    rate: float


def segments(
    profile: Profile, rate: float, duration_s: float, burst_multiplier: float = BURST_MULTIPLIER
) -> tuple[Segment, ...]:
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be positive, got {rate}")
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration must be positive, got {duration_s}")
    if profile == "steady":
        return (Segment(0.0, duration_s, rate),)
    if not (math.isfinite(burst_multiplier) and burst_multiplier > 0):
        raise ValueError(f"burst multiplier must be positive, got {burst_multiplier}")
    a, b = duration_s / 3, 2 * duration_s / 3
    return (
        Segment(0.0, a, rate),
        Segment(a, b, rate * burst_multiplier),
        Segment(b, duration_s, rate),
    )


def expected_arrivals(segs: Sequence[Segment]) -> float:
    return sum(s.rate * (s.end_s - s.start_s) for s in segs)


def arrival_times(segs: Sequence[Segment], rng: random.Random) -> list[float]:
    """Poisson arrival times in seconds from the start, ascending."""
    times: list[float] = []
    for seg in segs:
        t = seg.start_s + rng.expovariate(seg.rate)
        while t < seg.end_s:
            times.append(t)
            t += rng.expovariate(seg.rate)
    return times


@dataclass(frozen=True, slots=True)
class PromptMix:
    long_fraction: float = 0.2
    short_words: tuple[int, int] = (8, 64)
    long_words: tuple[int, int] = (512, 2048)
    """At most 2048 words keeps a request under the ingress topic's 20 KiB record limit."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long fraction must be in [0, 1], got {self.long_fraction}")
        for lo, hi in (self.short_words, self.long_words):
            if not 1 <= lo <= hi:
                raise ValueError(f"bad word range ({lo}, {hi})")


def parse_mix(text: str) -> dict[Tier, float]:
    """``"basic=5,pro=3,enterprise=2"`` → weights summing to 1 (a tier left out gets 0)."""
    weights: dict[Tier, float] = dict.fromkeys(Tier, 0.0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            tier, weight = Tier(name.strip()), float(value)
        except ValueError:
            raise ValueError(f"expected tier=weight, got {part!r}") from None
        if not sep or not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"expected tier=weight with a weight >= 0, got {part!r}")
        weights[tier] = weight
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("the tier mix needs a positive weight")
    return {tier: w / total for tier, w in weights.items()}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    tier: Tier


def spread_tenants(n: int, mix: Mapping[Tier, float], prefix: str = "load") -> tuple[Tenant, ...]:
    """``n`` tenants named ``<prefix>-<tier>-<i>``, over the tiers by ``mix`` (largest
    remainder: each tier gets ``n × share`` rounded up or down, ``n`` in all). The names
    are stable, so a second run reuses the first run's tenants."""
    if n < 1:
        raise ValueError(f"need at least one tenant, got {n}")
    total = sum(mix.values())
    quotas = {tier: n * mix.get(tier, 0.0) / total for tier in Tier}
    counts = {tier: math.floor(q) for tier, q in quotas.items()}
    by_remainder = sorted(Tier, key=lambda t: counts[t] - quotas[t])
    for tier in by_remainder[: n - sum(counts.values())]:
        counts[tier] += 1
    return tuple(
        Tenant(f"{prefix}-{tier.value}-{i}", tier) for tier in Tier for i in range(counts[tier])
    )


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    at_s: float
    tenant: int
    """Index into the tenants."""
    long: bool
    words: int


def plan(
    segs: Sequence[Segment], tenants: int, mix: PromptMix, rng: random.Random
) -> list[PlannedRequest]:
    """Every request of a run, in arrival order."""
    planned = []
    for i, at in enumerate(arrival_times(segs, rng)):
        long = rng.random() < mix.long_fraction
        lo, hi = mix.long_words if long else mix.short_words
        planned.append(PlannedRequest(i, at, rng.randrange(tenants), long, rng.randint(lo, hi)))
    return planned


def prompt_text(request: PlannedRequest) -> str:
    """The request's prompt: ``words`` short words (built when sent, not kept in the plan)."""
    return " ".join(_VOCAB[(request.index + k) % len(_VOCAB)] for k in range(request.words))
