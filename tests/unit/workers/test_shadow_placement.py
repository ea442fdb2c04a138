"""Where a worker sends a shadow (shadows.shadow_partition, shadow_key): keyed with the
fleet's sampling secret, so that a producer choosing its request ids cannot pick the
worker that runs, and judges, its shadows; the worker refuses to start without it.

A count's tolerance is ``Z`` standard deviations of its binomial distribution."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import DispatchedRequest, InferenceRequest, SamplingParams, ShadowOrder
from services.common.sampling import SamplingSecretMissing, keyed_hash
from services.workers.settings import WorkerSettings
from services.workers.shadowing import Shadowing
from services.workers.shadows import shadow_key, shadow_partition

pytestmark = pytest.mark.unit

SECRET_A = bytes(range(32))
SECRET_B = bytes(range(1, 33))
Z = 5.0
N = 3000
PARTITIONS = range(8)
OWNED = {0, 3}
OTHERS = sorted(set(PARTITIONS) - OWNED)

ids_st = st.from_regex(r"[A-Za-z0-9._:@/-]{1,40}", fullmatch=True)


def within_binomial(count: int, n: int, p: float) -> bool:
    return abs(count - n * p) <= Z * math.sqrt(n * p * (1 - p))


def dispatch(rid: str, tenant: str = "t") -> DispatchedRequest:
    request = InferenceRequest(
        request_id=rid,
        tenant=tenant,
        prompt="where is my order",
        sampling=SamplingParams(max_tokens=40, temperature=0.0),
        reply_to="seawall.replies.x",
        created_at=time.time(),
    )
    return DispatchedRequest(
        request=request,
        pool="main",
        admitted_at=time.time(),
        shadow=ShadowOrder(pool="main", min_similarity=0.5),
    )


@given(st.binary(min_size=32, max_size=64), ids_st)
def test_the_partition_is_the_keyed_hash_of_the_id_among_the_others(
    secret: bytes, rid: str
) -> None:
    d = dispatch(rid)
    picked = shadow_partition(d, PARTITIONS, OWNED, secret)
    assert picked == OTHERS[keyed_hash(secret, d.request.scoped_id) % len(OTHERS)]
    assert picked not in OWNED
    assert shadow_partition(d, PARTITIONS, OWNED, secret) == picked  # every time
    assert shadow_partition(d, PARTITIONS, set(PARTITIONS), secret) is None
    # the key (which places a shadow on another pool's topic) is the keyed hash too, not
    # the id its producer chose
    assert (
        shadow_key(d, secret) == f"shadow:{keyed_hash(secret, d.request.scoped_id):016x}".encode()
    )


@pytest.mark.parametrize("secret", [SECRET_A, SECRET_B], ids=["secret-a", "secret-b"])
def test_shadows_spread_evenly_over_the_other_workers_partitions(secret: bytes) -> None:
    picks = [shadow_partition(dispatch(f"r{i}"), PARTITIONS, OWNED, secret) for i in range(N)]
    share = 1 / len(OTHERS)
    for partition in OTHERS:
        count = picks.count(partition)
        assert within_binomial(count, N, share), (partition, count)


def test_ids_chosen_for_one_partition_without_the_secret_spread_like_any() -> None:
    """A producer that picks ids whose shadows go to one partition under a secret it can
    compute (here a wrong guess) has ids that, under the fleet's, spread evenly."""
    target, share = OTHERS[0], 1 / len(OTHERS)
    candidates = (dispatch(f"aim-{i}") for i in range(10 * N))
    aimed = [d for d in candidates if shadow_partition(d, PARTITIONS, OWNED, SECRET_B) == target]
    n = len(aimed)
    assert n >= N  # enough to judge
    landed = sum(shadow_partition(d, PARTITIONS, OWNED, SECRET_A) == target for d in aimed)
    assert landed < n  # the secret changed the placement
    assert within_binomial(landed, n, share), (landed, n * share)
    keys = {shadow_key(d, SECRET_A) for d in aimed[:100]}
    assert keys.isdisjoint({shadow_key(d, SECRET_B) for d in aimed[:100]})


def test_a_worker_without_the_sampling_secret_does_not_start(tmp_path: Path) -> None:
    settings = WorkerSettings(_env_file=None, control_signatures="off")
    assert settings.sampling_secret_file is None
    kwargs: dict[str, Any] = {
        "engine": None,
        "producer": None,
        "topics": None,
        "summary": None,
        "partitions": frozenset,
        "clock": None,
    }
    with pytest.raises(SamplingSecretMissing, match="SEAWALL_SAMPLING_SECRET_FILE"):
        Shadowing(settings=settings, **kwargs)
    path = tmp_path / "secret"
    path.write_text(SECRET_A.hex() + "\n")
    keyed = WorkerSettings(_env_file=None, control_signatures="off", sampling_secret_file=path)
    assert Shadowing(settings=keyed, **kwargs)._secret == SECRET_A
