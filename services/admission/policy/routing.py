"""Where a request goes, and what its pool lets through now (pure: no Kafka, no Redis).

Control state is read per pool: the ``pool:<name>`` scope, else ``fleet``.

Breaker (the destination pool's, when its state is not ``closed``): level 1 log — no
change (the service logs each change); level 2 rate limit — the pool is paced to
``rate_limit_factor`` of its batch slots; level 3 reject new and level 4 (emergency:
the pool's workers restart, the pool drains) — every request for the pool rejected
(``breaker_open``, ``Retry-After``); half-open at level 3+ lets ``probe_requests``
requests through per half-open *decision* (per admission instance), so that the
controller sees the probes it needs to close the circuit. A decision is told from its
re-publications by ``issued_at``, which re-publication keeps: re-publishing every few
seconds must not let another batch of probes through each time.

Degradation ladder (the requested pool's level; cumulative, as the controller issues
it): 1 — non-VIP classes are diverted to the small pool (``diverted_from``), unless
the request is longer than the small pool's workers can run; 2 — also,
long requests (``max_tokens`` above the cap; shorter ones are untouched) are capped
(``max_tokens_cap``); 3 — everyone gets the static reply (``static_reply``; no GPU time,
no diversion). ``Degradation.level`` is the highest rung applied to the request.

Canary split (``TrafficSplit`` of the requested pool, while a canary release runs):
the pool's traffic is shared with its canary pool (``<pool>.canary-<version>``) by
weight, before anything else is decided, so the canary pool's own breaker, ladder and
capacity govern what it takes. A request's side follows a hash of its session (else
its request id): a session stays on one side, and as the canary's share grows the
sessions already on it stay there. The hash is keyed with the fleet's sampling secret
(``services.common.sampling``): the producer chooses its session and request ids, and
could otherwise pick ids that land on the canary, or stay off it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from schemas import (
    BreakerLevel,
    BreakerState,
    Degradation,
    DegradationLevel,
    InferenceRequest,
    Priority,
    Tier,
    TrafficSplit,
)
from seawall_client.topics import base_pool
from services.admission.policy.config import PolicyConfig
from services.admission.policy.sizing import NO_LIMITS, fits, sequence_tokens
from services.common.control_state import ControlState, isolates

E = TypeVar("E", BreakerState, DegradationLevel)


@dataclass(frozen=True, slots=True)
class PoolGate:
    """What a pool's breaker lets through now."""

    refuse: bool = False
    factor: float = 1.0
    """The share of the pool's batch slots to fill."""
    level: BreakerLevel = BreakerLevel.NONE
    probes_left: int | None = None
    """Half-open: how many more requests may pass; ``None``: no such limit."""


OPEN_GATE = PoolGate()
"""A pool whose breaker is closed: everything passes."""
UNDEGRADED = Degradation()
"""The degradation of a request admission changed nothing about (frozen: shared)."""


def worker_share(breaker: BreakerState, rate_limit_factor: float) -> float:
    """The part of its batch slots a worker's own breaker leaves it: none when the state
    isolates it (``control.isolates``); ``rate_limit_factor`` when it is open for latency
    alone (level 2, rate limit) — the worker keeps serving, fewer at a time, so its P99
    can be seen to recover, where isolating it would leave its latency window empty and
    a small pool with no capacity at all; all of them otherwise (closed, half-open: the
    probes are ordinary requests)."""
    if isolates(breaker):
        return 0.0
    if breaker.state == "open" and breaker.level == BreakerLevel.RATE_LIMIT:
        return rate_limit_factor
    return 1.0


def sticky_point(secret: bytes, key: str) -> float:
    """``key``'s place in [0, 1) under the fleet's sampling ``secret``: the same on every
    replica and in every process, and not computable by whoever chose ``key`` (a
    producer) without the secret (``services.common.sampling.keyed_point``, here for
    the policy to stay pure)."""
    digest = hashlib.blake2b(key.encode(), key=secret, digest_size=8).digest()
    return int.from_bytes(digest) / 2**64


def canaries_of(split: TrafficSplit) -> list[str]:
    """The canary pools ``split`` shares its pool's traffic with, in name order: only
    the pool's own canaries (any other target is ignored)."""
    return sorted(t for t in split.weights if t != split.pool and base_pool(t) == split.pool)


def _scoped(control: ControlState, kind: type[E], pool: str) -> E | None:
    """A pool's own decision, else the fleet-wide one."""
    return control.get(kind, f"pool:{pool}") or control.get(kind, "fleet")


class PoolRouting:
    """Routing and pool gates of ``AdmissionPolicy``, plus the half-open probe budget (the
    only state kept)."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._probes_used: dict[str, tuple[float, int]] = {}
        """Breaker control key → (``issued_at`` of the half-open decision, probes let
        through under it)."""

    # -- routing -------------------------------------------------------------------
    def requested_pool(self, request: InferenceRequest) -> str:
        if request.tier is Tier.ENTERPRISE:
            return self.config.enterprise_pools.get(request.pool, request.pool)
        return request.pool

    def split(self, pool: str, request: InferenceRequest, control: ControlState) -> str:
        """The pool or canary pool that takes this request (see "Canary split")."""
        event = control.get(TrafficSplit, f"pool:{pool}")
        if event is None:
            return pool
        point = sticky_point(self.config.sampling_secret, f"{pool}/{request.dispatch_key}")
        share = 0.0
        for target in canaries_of(event):
            share += event.weights[target]
            if point < share:
                return target
        return pool

    def pools(self, control: ControlState) -> tuple[str, ...]:
        """The configured pools and the canary pools their splits send work to now."""
        canaries = {
            target
            for event in control.all(TrafficSplit)
            for target in canaries_of(event)
            if target not in self.config.pools
        }
        return (*self.config.pools, *sorted(canaries))

    def destination(self, pool: str, cls: Priority, control: ControlState) -> str:
        """Where the work of class ``cls`` for ``pool`` goes now (level 1 diverts)."""
        event = _scoped(control, DegradationLevel, pool)
        if event is None or event.level not in (1, 2) or cls is Priority.VIP:
            return pool
        target = event.small_pool or self.config.small_pool
        return target if target in self.config.pools else pool

    def route(
        self,
        pool: str,
        cls: Priority,
        request: InferenceRequest,
        control: ControlState,
        model_lens: Mapping[str, int] = NO_LIMITS,
    ) -> tuple[str, int, Degradation]:
        """Destination pool, rung applied and degradation for a request of ``pool``."""
        event = _scoped(control, DegradationLevel, pool)
        if event is None or event.level == 0:
            return pool, 0, UNDEGRADED
        if event.level >= 3:
            return pool, 3, Degradation(level=3, static_reply=True)
        dest = self.destination(pool, cls, control)
        if not fits(sequence_tokens(request), dest, model_lens):
            dest = pool  # the small pool cannot run it: it stays where it was asked
        rung = 1 if dest != pool else 0
        cap: int | None = None
        limit = event.max_tokens_cap or self.config.max_tokens_cap
        if event.level >= 2 and request.sampling.max_tokens > limit:
            rung, cap = 2, limit
        diverted_from = pool if dest != pool else None
        return dest, rung, Degradation(level=rung, diverted_from=diverted_from, max_tokens_cap=cap)

    def gate(self, pool: str, control: ControlState) -> PoolGate:
        breaker = _scoped(control, BreakerState, pool)
        if breaker is None or breaker.state == "closed":
            return OPEN_GATE
        level = breaker.level
        if level >= BreakerLevel.REJECT_NEW:
            if breaker.state == "open":
                return PoolGate(refuse=True, level=level)
            issued, used = self._probes_used.get(breaker.control_key, (breaker.issued_at, 0))
            left = breaker.probe_requests - (used if issued == breaker.issued_at else 0)
            return PoolGate(refuse=left <= 0, level=level, probes_left=max(0, left))
        factor = self.config.rate_limit_factor if level == BreakerLevel.RATE_LIMIT else 1.0
        return PoolGate(factor=factor, level=level)

    def _spend_probe(self, pool: str, control: ControlState) -> None:
        breaker = _scoped(control, BreakerState, pool)
        assert breaker is not None
        issued, used = self._probes_used.get(breaker.control_key, (breaker.issued_at, 0))
        used = used + 1 if issued == breaker.issued_at else 1
        self._probes_used[breaker.control_key] = (breaker.issued_at, used)
