"""The canary split and the shadow sample hash the request's ids under the fleet's
sampling secret (routing.sticky_point, services.common.sampling): deterministic for a
secret, alike on every replica that holds it, the configured share of requests, and
nothing a producer choosing its ids can aim without the secret.

Statistical checks bound a count by its binomial distribution: ``Z`` standard
deviations either side of the mean (a check that holds by chance alone fails about
once in 1.7 million)."""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import Evidence, InferenceRequest, Priority, SamplingParams, Tier, TrafficSplit
from seawall_client.clock import ManualClock
from services.admission.policy.bucket import Limit, TierConfig
from services.admission.policy.config import PolicyConfig
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.policy.outcomes import Accepted, Admit
from services.admission.policy.routing import sticky_point
from services.common.control_state import ControlState
from services.common.sampling import keyed_point

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0
SECRET_A = bytes(range(32))
SECRET_B = bytes(range(100, 132))
CANARY = "main.canary-v2"
Z = 5.0
"""Standard deviations of the binomial a count may stray from its mean (two-sided,
about 5.7e-7 by chance)."""
N = 4000
TIERS = {t: TierConfig(t, Limit(1e9, 1e9), Limit(1e12, 1e12)) for t in Tier}
NO_CONTROL = ControlState(ManualClock(NOW))

secrets_st = st.binary(min_size=32, max_size=64)
sessions_st = st.from_regex(r"[A-Za-z0-9._:@/-]{1,30}", fullmatch=True)


def within_binomial(count: int, n: int, p: float) -> bool:
    """Whether ``count`` successes of ``n`` trials is within ``Z`` standard deviations of
    a binomial(n, p)'s mean."""
    return abs(count - n * p) <= Z * math.sqrt(n * p * (1 - p))


def policy(secret: bytes, shadows: float = 0.0) -> AdmissionPolicy:
    config = PolicyConfig(TIERS, sampling_secret=secret, consistency_sample=shadows)
    return AdmissionPolicy(config)


def control(share: float) -> ControlState:
    state = ControlState(ManualClock(NOW))
    weights = {"main": 1.0 - share, CANARY: share} if share < 1 else {CANARY: 1.0}
    state.apply(
        TrafficSplit(
            scope="pool:main",
            seq=1,
            issued_at=NOW,
            evidence=Evidence(reason="t"),
            pool="main",
            weights=weights,
        )
    )
    return state


def request(rid: str, session: str | None = None, temperature: float = 0.0) -> InferenceRequest:
    return InferenceRequest.model_validate(
        {
            "request_id": rid,
            "tenant": "acme",
            "tier": Tier.PRO,
            "pool": "main",
            "prompt": "hello",
            "sampling": SamplingParams(max_tokens=16, temperature=temperature),
            "reply_to": "replies",
            "created_at": NOW - 1,
            "session_id": session,
        }
    )


def on_canary(p: AdmissionPolicy, state: ControlState, session: str) -> bool:
    return p.split("main", request(f"r-{session}", session), state) == CANARY


ADMITTED = Accepted("main", Priority.STANDARD, False, 1.0)


def shadowed(p: AdmissionPolicy, rid: str) -> bool:
    verdict = p.release(request(rid), Priority.STANDARD, ADMITTED, NO_CONTROL, NOW)
    assert isinstance(verdict, Admit)
    return verdict.dispatch.shadow is not None


# -- the hash --------------------------------------------------------------------------


@given(secrets_st, st.text(max_size=40))
def test_the_point_is_keyed_blake2b_in_the_unit_interval(secret: bytes, key: str) -> None:
    digest = hashlib.blake2b(key.encode(), key=secret, digest_size=8).digest()
    point = sticky_point(secret, key)
    assert point == int.from_bytes(digest) / 2**64
    assert 0.0 <= point < 1.0
    assert point == keyed_point(secret, key)  # the workers' hash is the same function
    assert point == sticky_point(bytes(secret), str(key))  # deterministic


def test_the_point_depends_on_the_secret_not_on_the_id_alone() -> None:
    ids = [f"session-{i}" for i in range(1000)]
    unkeyed = [int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest()) for k in ids]
    assert [sticky_point(SECRET_A, k) for k in ids] != [u / 2**64 for u in unkeyed]
    assert [sticky_point(SECRET_A, k) for k in ids] != [sticky_point(SECRET_B, k) for k in ids]


# -- the canary split ------------------------------------------------------------------


@settings(max_examples=50)
@given(secrets_st, sessions_st, st.floats(0.0, 1.0))
def test_two_replicas_with_one_secret_put_a_session_on_the_same_side(
    secret: bytes, session: str, share: float
) -> None:
    state = control(share)
    sides = {policy(secret).split("main", request("r", session), state) for _ in range(2)}
    assert len(sides) == 1
    assert sides <= {"main", CANARY}


@settings(max_examples=50)
@given(secrets_st, st.lists(st.floats(0.01, 1.0), min_size=2, max_size=5), sessions_st)
def test_under_any_secret_a_session_on_the_canary_stays_there_as_its_share_grows(
    secret: bytes, shares: list[float], session: str
) -> None:
    p = policy(secret)
    was = False
    for share in sorted(shares):
        now = on_canary(p, control(share), session)
        assert now or not was
        was = now
    assert on_canary(p, control(1.0), session)


@pytest.mark.parametrize("share", [0.05, 0.25, 0.5])
@pytest.mark.parametrize("secret", [SECRET_A, SECRET_B], ids=["secret-a", "secret-b"])
def test_the_canary_takes_its_share_of_sessions(secret: bytes, share: float) -> None:
    p, state = policy(secret), control(share)
    taken = sum(on_canary(p, state, f"s{i}") for i in range(N))
    assert within_binomial(taken, N, share), (taken, N * share)


@pytest.mark.parametrize("share", [0.05, 0.25])
def test_ids_chosen_without_the_secret_reach_the_canary_no_more_than_any(share: float) -> None:
    """A producer that picks the sessions landing on the canary under every secret it
    can compute (none, or a guessed one) has picked sessions that, under the fleet's
    secret, land there at the canary's share: no better than sessions picked at random.
    (Unkeyed, as before, every one of them did.)"""
    n = N // 2
    state, fleet = control(share), policy(SECRET_A)
    candidates = [f"aim-{i}" for i in range(40 * n)]
    for guess in (b"", SECRET_B):  # unkeyed (the old hash), or a wrong secret
        guessed = policy(guess)
        aims = {s: on_canary(guessed, state, s) for s in candidates}
        chosen = [s for s in candidates if aims[s]][:n]
        assert len(chosen) == n
        landed = sum(on_canary(fleet, state, s) for s in chosen)
        assert within_binomial(landed, n, share), (guess, landed, n * share)
        # and those it aimed off the canary are on it at the same share
        avoided = [s for s in candidates if not aims[s]][:n]
        landed = sum(on_canary(fleet, state, s) for s in avoided)
        assert within_binomial(landed, n, share), (guess, landed, n * share)


# -- the shadow sample -----------------------------------------------------------------


@pytest.mark.parametrize("share", [0.02, 0.1, 0.5])
@pytest.mark.parametrize("secret", [SECRET_A, SECRET_B], ids=["secret-a", "secret-b"])
def test_the_configured_share_of_repeatable_requests_is_shadowed(
    secret: bytes, share: float
) -> None:
    p = policy(secret, shadows=share)
    sampled = [shadowed(p, f"r{i}") for i in range(N)]
    assert within_binomial(sum(sampled), N, share), (sum(sampled), N * share)
    # the same on another replica holding the secret, and on a redelivery
    assert [shadowed(policy(secret, shadows=share), f"r{i}") for i in range(N)] == sampled


def test_the_shadow_sample_changes_with_the_secret_and_cannot_be_aimed_without_it() -> None:
    share, n = 0.1, N // 2
    a, b = policy(SECRET_A, shadows=share), policy(SECRET_B, shadows=share)
    ids = [f"r{i}" for i in range(20 * n)]
    aims = {rid: shadowed(b, rid) for rid in ids}
    under_b = [rid for rid in ids if aims[rid]][:n]
    assert len(under_b) == n
    assert sum(shadowed(a, rid) for rid in under_b) < n  # the secret changed the sample
    # what a producer aiming for (or away from) shadows under another secret gets
    assert within_binomial(sum(shadowed(a, rid) for rid in under_b), n, share)
    dodging = [rid for rid in ids if not aims[rid]][:n]
    assert within_binomial(sum(shadowed(a, rid) for rid in dodging), n, share)
    # the split and the shadow sample are different coins for one id
    assert sticky_point(SECRET_A, "main/x") != sticky_point(SECRET_A, "shadow/x")
