"""The incident benchmark's scenario: the fleet, the traffic and the tenants' quotas.

Pure data and seeded generators; ``incident.py`` runs the same arrivals through both
harnesses (``_incident_runs``).

Traffic: customer-service requests (short prompts, short answers) from tenants of the
three tiers, Poisson arrivals at ``steady_rate``; for ``burst_s`` the rate is
``burst_factor`` times higher and ``long_share`` of the prompts are long (pasted order
histories and documents, ``long_prompt`` tokens), then the steady traffic returns. Every
request asks for exactly the answer length it gets (the simulator generates
``max_tokens``), and its client gives up after ``timeout_s``.

Fleet: ``main_gpus`` engines of the main model and ``small_gpus`` of the small pool's
model, each built as a seawall worker builds its simulated engine by default
(``WorkerSettings`` → ``sim_config``: A100 80GB, ``max_num_seqs`` 64,
``max_num_batched_tokens`` 8192, seed 1's settings).

Quotas (the operator's per-tenant contracts, DESIGN "Tiers and priority"): basic tenants
may use ``quota_headroom`` times their steady request and token rates (a strict bucket);
pro tenants as much again from a burst level (served degraded, not rejected); enterprise
contracts cover ``quota_headroom`` times their sales-event peak, so that no VIP request is
shed by its quota. Every bucket is ``quota_depth_s`` seconds of its rate deep.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any, Final

from schemas import Priority, Tier
from schemas.requests import TIER_PRIORITY
from services.admission.policy.bucket import Limit, TierConfig
from services.workers.engine.factory import sim_config
from services.workers.engine.sim_config import SimConfig
from services.workers.settings import WorkerSettings

EPOCH: Final = 1_800_000_000.0
"""Virtual time 0 on the wire's clock (timestamps must be epoch seconds)."""
CLASSES: Final = (Priority.VIP, Priority.STANDARD, Priority.BULK)


@dataclass(frozen=True)
class Lengths:
    """Log-normal token counts around ``mean``, clipped to ``[low, high]``."""

    mean: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma * self.sigma / 2
        return min(self.high, max(self.low, round(rng.lognormvariate(mu, self.sigma))))


def _mix() -> dict[Tier, float]:
    return {Tier.BASIC: 0.50, Tier.PRO: 0.35, Tier.ENTERPRISE: 0.15}


def _tenants() -> dict[Tier, int]:
    return {Tier.BASIC: 40, Tier.PRO: 10, Tier.ENTERPRISE: 4}


@dataclass(frozen=True)
class Scenario:
    seed: int = 1
    steady_s: float = 120.0
    """Steady traffic before the burst (its first ``warmup_s`` are not measured)."""
    warmup_s: float = 20.0
    burst_s: float = 40.0
    after_s: float = 80.0
    steady_rate: float = 32.0
    """Requests per second, whole fleet."""
    burst_factor: float = 5.0
    long_share: float = 0.30
    """Share of long prompts during the burst (none in steady traffic)."""
    prompt: Lengths = Lengths(200.0, 0.6, 16, 1024)
    long_prompt: tuple[int, int] = (1500, 3500)
    """Uniform token counts of a long prompt (the main model's context is 4096)."""
    output: Lengths = Lengths(32.0, 0.6, 4, 128)
    mix: Mapping[Tier, float] = field(default_factory=_mix)
    """Share of the requests per tier (the same in steady traffic and in the burst)."""
    tenants: Mapping[Tier, int] = field(default_factory=_tenants)
    timeout_s: float = 10.0
    """The client's timeout, sent as the request's deadline."""
    slo_s: float = 1.5
    """Goodput counts answers within this latency (the seeds' target P99)."""
    main_gpus: int = 16
    small_gpus: int = 4
    main_model: str = "llama-2-7b"
    small_model: str = "llama-3.2-1b"
    gpu: str = "a100-80g"
    quota_headroom: float = 2.0
    quota_depth_s: float = 20.0

    @property
    def burst_start(self) -> float:
        return self.steady_s

    @property
    def burst_end(self) -> float:
        return self.steady_s + self.burst_s

    @property
    def end(self) -> float:
        return self.burst_end + self.after_s

    def windows(self) -> dict[str, tuple[float, float]]:
        """Reporting windows, by arrival time: ``burst`` is the whole burst, split into
        its ``onset`` (the first quarter, while the quota buckets still hold their depth
        and before any controller window has filled) and the ``sustained`` rest."""
        onset_end = self.burst_start + self.burst_s / 4
        return {
            "steady": (self.warmup_s, self.burst_start),
            "burst": (self.burst_start, self.burst_end),
            "burst_onset": (self.burst_start, onset_end),
            "burst_sustained": (onset_end, self.burst_end),
            "after": (self.burst_end, self.end),
        }

    def engine(self, model: str) -> SimConfig:
        """The simulated engine a seawall worker builds for ``model`` by default."""
        return sim_config(WorkerSettings.model_construct(sim_model=model, sim_gpu=self.gpu))

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["mix"] = {t.value: s for t, s in self.mix.items()}
        out["tenants"] = {t.value: n for t, n in self.tenants.items()}
        out["windows_s"] = self.windows()
        return out


@dataclass(frozen=True, slots=True)
class Arrival:
    index: int
    at: float
    tenant: str
    tier: Tier
    prompt_tokens: int
    max_tokens: int
    long: bool

    @property
    def priority(self) -> Priority:
        return TIER_PRIORITY[self.tier]

    @property
    def request_id(self) -> str:
        return f"r{self.index}"


def _draw_request(
    s: Scenario, rng: random.Random, long_share: float
) -> tuple[Tier, str, int, int, bool]:
    tiers = list(s.mix)
    tier = rng.choices(tiers, weights=[s.mix[t] for t in tiers])[0]
    tenant = f"{tier.value}-{rng.randrange(s.tenants[tier]):02d}"
    long = rng.random() < long_share
    prompt = rng.randint(*s.long_prompt) if long else s.prompt.draw(rng)
    return tier, tenant, prompt, s.output.draw(rng), long


def arrivals(s: Scenario) -> list[Arrival]:
    """The traffic of one run (a function of the scenario and its seed)."""
    rng = random.Random(s.seed)
    phases = (
        (0.0, s.burst_start, s.steady_rate, 0.0),
        (s.burst_start, s.burst_end, s.steady_rate * s.burst_factor, s.long_share),
        (s.burst_end, s.end, s.steady_rate, 0.0),
    )
    out: list[Arrival] = []
    for start, end, rate, long_share in phases:
        t = start + rng.expovariate(rate)
        while t < end:
            tier, tenant, prompt, output, long = _draw_request(s, rng, long_share)
            out.append(Arrival(len(out), t, tenant, tier, prompt, output, long))
            t += rng.expovariate(rate)
    return out


def sample(s: Scenario, long_share: float, n: int = 5_000) -> list[tuple[int, int]]:
    """(prompt, answer) tokens of ``n`` requests of the steady (``long_share`` 0) or the
    burst mix, on a seed of their own (not the run's arrivals)."""
    rng = random.Random(f"{s.seed}:sample:{long_share}")
    return [_draw_request(s, rng, long_share)[2:4] for _ in range(n)]


def _mean_tokens(s: Scenario, long_share: float) -> float:
    """Expected prompt + answer tokens of a request."""
    requests = sample(s, long_share)
    return sum(p + o for p, o in requests) / len(requests)


def tier_configs(s: Scenario) -> dict[Tier, TierConfig]:
    """Each tier's per-tenant bucket (see the module docstring)."""
    steady_tokens = _mean_tokens(s, 0.0)
    peak_tokens = _mean_tokens(s, s.long_share)

    def limit(rate: float, burst: bool = False) -> Limit:
        depth = s.quota_depth_s * rate
        return Limit(depth, rate, depth if burst else 0.0, rate if burst else 0.0)

    out: dict[Tier, TierConfig] = {}
    for tier in Tier:
        per_tenant = s.steady_rate * s.mix[tier] / s.tenants[tier]
        requests, tokens = per_tenant, per_tenant * steady_tokens
        if tier is Tier.ENTERPRISE:
            requests, tokens = (
                per_tenant * s.burst_factor,
                per_tenant * s.burst_factor * peak_tokens,
            )
        h = s.quota_headroom
        burst = tier is Tier.PRO
        out[tier] = TierConfig(tier, limit(requests * h, burst), limit(tokens * h, burst))
    return out


@cache
def prompt_text(tokens: int) -> str:
    """A prompt of exactly ``tokens`` tokens for ``count_tokens`` (a run of letters counts
    one token per four; one run is the cheapest text to count)."""
    return "a" * (4 * tokens)
