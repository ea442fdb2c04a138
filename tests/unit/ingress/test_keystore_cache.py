"""The key cache: made-up key ids never push real keys out of it."""

from __future__ import annotations

from typing import Any, cast

import pytest

from seawall_client.clock import ManualClock
from seawall_client.topics import RedisKeys
from services.ingress.keystore import AuditLog, KeyStore
from services.ingress.policy.keys import KeyRecord

pytestmark = pytest.mark.unit


async def test_a_flood_of_unknown_key_ids_does_not_evict_a_real_key() -> None:
    clock = ManualClock()
    store = KeyStore(
        cast(Any, None), RedisKeys(), b"p" * 32, cast(AuditLog, None),
        clock=clock, cache_s=2.0, cache_size=4,
    )  # fmt: skip
    real = KeyRecord("aaaaaaaaaaaa", "acme", "h", created_at=0.0)
    reads: list[str] = []

    async def read(key_id: str) -> KeyRecord | None:
        reads.append(key_id)
        return real if key_id == real.key_id else None

    store._read = read  # type: ignore[method-assign]  # Redis is not the point here
    assert await store.get(real.key_id) == real
    for i in range(100):  # made-up ids, each read once and remembered as absent
        assert await store.get(f"{i:012x}") is None
    assert await store.get(f"{99:012x}") is None  # remembered: no second read
    assert await store.get(real.key_id) == real  # still cached: no second read
    assert reads.count(real.key_id) == 1
    assert len(reads) == 101
    clock.advance(2.5)
    assert await store.get(real.key_id) == real  # the cache's time ran out: read again
    assert reads.count(real.key_id) == 2
