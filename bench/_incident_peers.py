"""What a platform team would run instead of seawall, on the incident's virtual time.

Each peer arm serves the same arrivals on the same GPUs as seawall's arm (every GPU of
the scenario, the small pool's included, serving the main model: the peers have no use
for a second model, so they get its GPUs as more replicas of the first), with the same
client behaviour (a client gives up at its timeout, and the server aborts its request,
as vLLM's OpenAI server does on a disconnect). Each is configured as its own
documentation recommends for this job; bench/README.md cites the source lines each
rule is taken from. The policies are pure (a router picks an engine from what it can
see, a gate admits or refuses) and unit-tested (tests/unit/bench/test_incident_peers.py);
``run_peer`` composes them on the discrete-event loop of ``_incident_des``.

- ``vllm``: vLLM alone, ``--scheduling-policy priority`` with a request's priority from
  its tier (lower is served first), replicas behind production-stack's router in its
  default round-robin, vLLM's own limits (``max_num_seqs``, ``max_num_batched_tokens``)
  and nothing in front: every request is queued.
- ``litellm``: the LiteLLM proxy (1.108.0) in front of the same replicas: each tenant's
  key limited to its contract per minute (``rpm_limit``, ``tpm_limit``: the tier quotas
  seawall's arm enforces, pro's burst level included), over-limit requests refused
  (429); the router's ``simple-shuffle`` (its default, which its routing docs recommend
  for production) spreading requests over the replicas. ``max_parallel_requests`` is
  not set: the tenants' contracts are rates, and no cap follows from them. Its request
  prioritisation (beta) releases a queued request as soon as any deployment is healthy,
  whatever its priority: with healthy engines it orders nothing, so it is left off.
- ``gie``: the Gateway API Inference Extension's endpoint picker (v1.5.0 defaults): each
  request to the replica with the best weighted score of a short waiting queue and a
  free KV cache, from metrics scraped every 50 ms; its saturation detector sheds
  sheddable (non-VIP) requests while the pool's mean saturation is 1 or more; VIP
  requests are always admitted. Its flow-control queue is off by default, and so here.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from _incident_des import Outcome, Replica, serve
from _incident_scenario import Arrival, Scenario, tier_configs

from schemas import Priority, Tier
from services.workers.engine.sim_core import SimCore

PRIORITY_VALUE = {Priority.VIP: 0, Priority.STANDARD: 1, Priority.BULK: 2}
"""vLLM's ``priority`` per class: lower values are scheduled first."""


class Router(Protocol):
    def pick(self, replicas: Sequence[Replica], arrival: Arrival) -> int: ...


class Gate(Protocol):
    def admit(self, now: float, arrival: Arrival, replicas: Sequence[Replica]) -> bool: ...


class AdmitAll:
    def admit(self, now: float, arrival: Arrival, replicas: Sequence[Replica]) -> bool:
        return True


@dataclass
class RoundRobin:
    """production-stack's default router: each request to the next replica in turn."""

    _next: int = 0

    def pick(self, replicas: Sequence[Replica], arrival: Arrival) -> int:
        i = self._next % len(replicas)
        self._next = i + 1
        return i


@dataclass
class SimpleShuffle:
    """LiteLLM's ``simple-shuffle``: a replica at random (equal weights when no
    deployment sets ``rpm``/``tpm``/``weight``)."""

    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def pick(self, replicas: Sequence[Replica], arrival: Arrival) -> int:
        return self.rng.randrange(len(replicas))


@dataclass
class FixedWindowLimits:
    """LiteLLM's per-key ``rpm_limit`` and ``tpm_limit`` (its proxy's
    ``parallel_request_limiter_v3``, 1.108.0): per key, a window of ``window_s`` that
    starts at the key's first request and restarts at the first request after it ends,
    both counters then at zero; a request is refused (429) when its key's requests, or
    its tokens with this request's, would pass the limit. Tokens are reserved at
    admission as the prompt and the answer's ``max_tokens`` (the proxy's default
    reservation) and corrected to what was used afterwards: the simulated engine answers
    exactly ``max_tokens``, so nothing is corrected here."""

    rpm: dict[Tier, float]
    tpm: dict[Tier, float]
    window_s: float = 60.0
    _windows: dict[str, list[float]] = field(default_factory=dict)
    """Per key: [window start, requests, tokens]."""

    def admit(self, now: float, arrival: Arrival, replicas: Sequence[Replica]) -> bool:
        w = self._windows.get(arrival.tenant)
        if w is None or now - w[0] >= self.window_s:
            w = self._windows[arrival.tenant] = [now, 0.0, 0.0]
        tokens = arrival.prompt_tokens + arrival.max_tokens
        if w[1] + 1 > self.rpm[arrival.tier] or w[2] + tokens > self.tpm[arrival.tier]:
            return False
        w[1] += 1
        w[2] += tokens
        return True


@dataclass
class GieScorer:
    """The endpoint picker's default profile (GIE v1.5.0, ``pkg/epp/config/loader/
    defaults.go``): ``queue-scorer`` weight 2 (1 for the shortest waiting queue, 0 for
    the longest, linear between; 1 for all when they are equal), ``kv-cache-utilization
    -scorer`` weight 2 (1 - KV cache usage), and ``prefix-cache-scorer`` weight 3, which
    scores every replica alike here (the incident's prompts share no prefix) and so
    changes no pick; ``max-score-picker``: the best weighted sum, ties at random."""

    queue_weight: float = 2.0
    kv_weight: float = 2.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def pick(self, replicas: Sequence[Replica], arrival: Arrival) -> int:
        lo = min(r.waiting for r in replicas)
        hi = max(r.waiting for r in replicas)
        scores = []
        for r in replicas:
            queue = 1.0 if hi == lo else (hi - r.waiting) / (hi - lo)
            scores.append(self.queue_weight * queue + self.kv_weight * (1.0 - r.kv_cache_usage))
        best = max(scores)
        return self.rng.choice([i for i, s in enumerate(scores) if s == best])


@dataclass
class SaturationShedding:
    """The default ``utilization-detector`` and legacy admission (GIE v1.5.0,
    ``saturationdetector/utilization/detector.go``, ``requestcontrol/admission.go``): a
    replica's saturation is ``max(waiting / queue_depth, kv_usage / kv_usage_limit)``
    (1 where its metrics are staler than 200 ms: never here, they are scraped every
    50 ms); the pool's is their mean; at 1 or more a sheddable request (priority below
    0) is refused with a 429. Priorities as its documentation has operators set them
    for this job: VIP 0 (never shed, never queued), every other class below 0."""

    queue_depth: int = 5
    kv_usage_limit: float = 0.8

    def saturation(self, replicas: Sequence[Replica]) -> float:
        if not replicas:
            return 1.0
        return sum(
            max(r.waiting / self.queue_depth, r.kv_cache_usage / self.kv_usage_limit)
            for r in replicas
        ) / len(replicas)

    def admit(self, now: float, arrival: Arrival, replicas: Sequence[Replica]) -> bool:
        return arrival.priority is Priority.VIP or self.saturation(replicas) < 1.0


@dataclass(frozen=True)
class Peer:
    name: str
    router: Callable[[], Router]
    gate: Callable[[Scenario], Gate]
    priority_policy: bool = False
    """The engines schedule by ``(priority, arrival)`` (vLLM's priority policy)."""
    refresh_s: float | None = None
    """How often the router's and gate's view of the replicas is refreshed (``None``:
    they see each replica as it is, as a proxy counting its own in-flight requests does)."""


def litellm_limits(s: Scenario) -> FixedWindowLimits:
    """Each tier's per-tenant contract as LiteLLM key limits per minute: the rate seawall's
    bucket refills at, pro's burst level added (LiteLLM has no degraded band: past its
    limit a request is refused), its depth not (a window is its own burst)."""
    rpm, tpm = {}, {}
    for tier, c in tier_configs(s).items():
        rpm[tier] = 60 * (c.requests.rate + c.requests.burst_rate)
        tpm[tier] = 60 * (c.tokens.rate + c.tokens.burst_rate)
    return FixedWindowLimits(rpm, tpm)


PEERS: tuple[Peer, ...] = (
    Peer("vllm", RoundRobin, lambda s: AdmitAll(), priority_policy=True),
    Peer("litellm", SimpleShuffle, litellm_limits),
    Peer("gie", GieScorer, lambda s: SaturationShedding(), refresh_s=0.05),
)


def peer_engines(s: Scenario, priority_policy: bool) -> list[SimCore]:
    """Every GPU of the scenario as a replica of the main model."""
    config = dataclasses.replace(
        s.engine(s.main_model), scheduling_policy="priority" if priority_policy else "fcfs"
    )
    return [SimCore(config, seed=i) for i in range(s.main_gpus + s.small_gpus)]


def run_peer(s: Scenario, arrivals: Sequence[Arrival], peer: Peer) -> list[Outcome]:
    router, gate = peer.router(), peer.gate(s)
    return serve(
        arrivals,
        peer_engines(s, peer.priority_policy),
        s.timeout_s,
        router.pick,
        gate.admit,
        priority_of=lambda a: PRIORITY_VALUE[a.priority],
        refresh_s=peer.refresh_s,
    )


def refused_share(outcomes: Sequence[Outcome]) -> float | None:
    if not outcomes:
        return None
    return sum(1 for o in outcomes if o.kind == "rejected") / len(outcomes)
