"""The Redis-independent parts of quota.py: key layout and the Redis-down policy."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from schemas import Tier
from services.admission.quota import on_redis_down, quota_key

pytestmark = pytest.mark.unit


def test_keys_share_a_slot_per_tenant() -> None:
    r = quota_key("seawall:", "acme", "requests")
    t = quota_key("seawall:", "acme", "tokens")
    assert r == "seawall:quota:{acme}:requests"
    assert key_slot(r.encode()) == key_slot(t.encode())
    assert key_slot(r.encode()) == key_slot(b"acme")


@pytest.mark.parametrize(
    ("prefix", "tenant"), [("seawall:", ""), ("seawall:", "a}b"), ("{x}", "a")]
)
def test_keys_refuse_hash_tag_breakers(prefix: str, tenant: str) -> None:
    with pytest.raises(ValueError, match=r"braces|empty"):
        quota_key(prefix, tenant, "tokens")


def test_redis_down_policy_per_tier() -> None:
    ent, pro, basic = (on_redis_down(t) for t in (Tier.ENTERPRISE, Tier.PRO, Tier.BASIC))
    assert (ent.outcome, pro.outcome, basic.outcome) == ("admit", "degrade", "reject")
    assert {ent.reason, pro.reason, basic.reason} == {"quota_unavailable"}
    assert basic.headers() == {"Retry-After": "1"}
    assert ent.headers() == {}
    assert pro.headers() == {}
    assert on_redis_down(Tier.BASIC, retry_after_s=2.5).headers() == {"Retry-After": "3"}
