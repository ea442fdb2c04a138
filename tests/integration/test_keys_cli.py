"""``seawall keys`` against the real Redis and broker (typer's CliRunner)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from typer.testing import CliRunner, Result

from schemas import AuditEvent
from seawall.keys import keys_app
from seawall_client import signing
from seawall_client.topics import RedisKeys, Topics
from services.common.bus import make_consumer
from services.common.settings import CommonSettings
from services.ingress.policy.keys import hash_key

pytestmark = pytest.mark.integration

PEPPER = "cli-test-pepper-0123456789"


@pytest.fixture
def env(settings: CommonSettings) -> dict[str, str]:
    return {
        "SEAWALL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "SEAWALL_KAFKA_IDEMPOTENCE": str(settings.kafka_idempotence).lower(),
        "SEAWALL_REDIS_URL": settings.redis_url,
        "SEAWALL_REDIS_PREFIX": settings.redis_prefix,
        "SEAWALL_TOPIC_PREFIX": settings.topic_prefix,
        "SEAWALL_CONTROL_KEYS_DIR": str(settings.control_keys_dir),
        "SEAWALL_KEY_PEPPER": PEPPER,
        "COLUMNS": "200",
    }


async def keys(env: dict[str, str], *args: str) -> Result:
    """Run ``seawall keys ...`` in a thread: the command runs its own event loop."""
    return await asyncio.to_thread(lambda: CliRunner().invoke(keys_app, list(args), env=env))


async def listing(env: dict[str, str], *args: str) -> dict[str, dict[str, Any]]:
    result = await keys(env, "list", "--json", *args)
    assert result.exit_code == 0, result.output
    return {row["key_id"]: row for row in json.loads(result.stdout)}


async def test_create_list_rotate_revoke(
    env: dict[str, str], settings: CommonSettings, topics: Topics, redis: aioredis.Redis
) -> None:
    created = await keys(env, "create", "--tenant", "acme", "--tier", "pro", "--json")
    assert created.exit_code == 0, created.output
    doc = json.loads(created.stdout)
    key, key_id = doc["key"], doc["key_id"]
    assert key.startswith(f"sk-sw-{key_id}_")
    assert (doc["tenant"], doc["tier"], doc["sensitive"]) == ("acme", "pro", "redact")

    # stored hashed, with its lifecycle dates; never the key itself
    layout = RedisKeys(settings.redis_prefix)
    raw = cast(dict[bytes, bytes], await redis.hgetall(layout.api_key(key_id)))
    stored = {k.decode(): v.decode() for k, v in raw.items()}
    assert stored["key_hash"] == hash_key(key, PEPPER.encode())
    assert set(stored) == {"tenant", "key_hash", "signing_key", "created_at", "mac"}
    assert key not in json.dumps(stored)
    # the record-signing key, wrapped under the pepper: not the key, nor usable alone
    signing_key = signing.signing_key(key)
    assert bytes.fromhex(stored["signing_key"]) != signing_key
    assert signing.unwrap(stored["signing_key"], PEPPER.encode(), key_id) == signing_key
    assert await redis.ttl(layout.api_key(key_id)) > 0  # expires once purged
    assert await redis.smembers(layout.tenant_keys("acme")) == {key_id.encode()}
    policy = await redis.hgetall(f"{settings.redis_prefix}tenant:{{acme}}:policy")
    assert {k: v for k, v in policy.items() if k != b"mac"} == {
        b"tier": b"pro",
        b"sensitive": b"redact",
    }
    assert len(policy[b"mac"]) == 64  # hex HMAC-SHA-256, checked on every read

    # the human form prints the key alone on standard output, the notice elsewhere
    human = await keys(env, "create", "--tenant", "acme", "--sensitive", "block")
    assert human.exit_code == 0, human.output
    assert human.stdout.strip().startswith("sk-sw-")
    assert "shown only this once" in human.stderr
    second_id = human.stdout.strip().split("_")[0].removeprefix("sk-sw-")

    rows = await listing(env)
    assert set(rows) == {key_id, second_id}
    assert {row["phase"] for row in rows.values()} == {"active"}
    assert {row["tier"] for row in rows.values()} == {"pro"}
    table = await keys(env, "list", "--tenant", "acme")
    assert table.exit_code == 0
    assert key_id in table.stdout
    assert "active" in table.stdout
    assert key not in table.stdout

    rotated = await keys(env, "rotate", key_id, "--json")
    assert rotated.exit_code == 0, rotated.output
    new = json.loads(rotated.stdout)
    assert new["replaces"] == key_id
    assert new["key"] != key
    rows = await listing(env, "--tenant", "acme")
    assert rows[key_id]["phase"] == "grace"
    assert rows[new["key_id"]]["phase"] == "active"
    # a key in its grace period may not rotate again
    again = await keys(env, "rotate", key_id)
    assert again.exit_code == 1
    assert "key_read_only" in again.stderr

    revoked = await keys(env, "revoke", second_id)
    assert revoked.exit_code == 0, revoked.output
    assert (await listing(env))[second_id]["phase"] == "revoked"

    missing = await keys(env, "revoke", "0123456789ab")
    assert missing.exit_code == 1
    assert "no key" in missing.stderr
    no_tier = await keys(env, "create", "--tenant", "newco")
    assert no_tier.exit_code == 2
    assert "give it a tier" in no_tier.stderr
    bad_name = await keys(env, "create", "--tenant", "has space", "--tier", "basic")
    assert bad_name.exit_code == 2

    actions = [e.action for e in await audit_events(settings, topics, 6)]
    assert actions == [
        "policy_changed",
        "key_created",
        "policy_changed",  # --sensitive block
        "key_created",
        "key_rotated",
        "key_revoked",
    ]


async def audit_events(settings: CommonSettings, topics: Topics, n: int) -> list[AuditEvent]:
    consumer = make_consumer(settings, topics.audit, group_id=None)
    await consumer.start()
    events: list[AuditEvent] = []
    try:
        deadline = time.monotonic() + 20
        while len(events) < n and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                events += [AuditEvent.model_validate_json(r.value) for r in records]
    finally:
        await consumer.stop()
    for event in events:
        assert event.actor.startswith("cli:")
        assert "sk-sw-" not in event.model_dump_json()
    return events


async def test_create_sets_and_clears_the_tenant_s_region(
    env: dict[str, str], settings: CommonSettings, redis: aioredis.Redis
) -> None:
    """``--region`` places the tenant (for its Kafka requests: regional throttles,
    hotspots), inside the policy's MAC; ``--region ''`` takes it out again."""
    policy_key = f"{settings.redis_prefix}tenant:{{eu-co}}:policy"
    created = await keys(
        env, "create", "--tenant", "eu-co", "--tier", "pro", "--region", "eu-west", "--json"
    )
    assert created.exit_code == 0, created.output
    assert json.loads(created.stdout)["region"] == "eu-west"
    assert await redis.hget(policy_key, "region") == b"eu-west"
    rows = await listing(env, "--tenant", "eu-co")
    assert {row["region"] for row in rows.values()} == {"eu-west"}
    # another key keeps the region; the human form says where the tenant is
    human = await keys(env, "create", "--tenant", "eu-co")
    assert human.exit_code == 0, human.output
    assert "region eu-west" in human.stderr
    moved = await keys(env, "create", "--tenant", "eu-co", "--region", "ap-east", "--json")
    assert json.loads(moved.stdout)["region"] == "ap-east"
    cleared = await keys(env, "create", "--tenant", "eu-co", "--region", "", "--json")
    assert cleared.exit_code == 0, cleared.output
    assert json.loads(cleared.stdout)["region"] is None
    assert await redis.hget(policy_key, "region") is None
    assert (await redis.hgetall(policy_key)).keys() == {b"tier", b"sensitive", b"mac"}
    for bad in ("has space", "{tag}", "x" * 65):
        refused = await keys(env, "create", "--tenant", "eu-co", "--region", bad)
        assert refused.exit_code == 2, bad
        assert "region" in refused.output
