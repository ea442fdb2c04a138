"""Key records and tenant policies carry a MAC under the pepper, checked on every read
(``services.ingress.keystore``): whoever writes Redis without the pepper can break a
key, never move it to another tenant, revive it or raise its tier. Against the running
ingress on the real Redis; the tampering is done as an attacker would, with plain
Redis commands on the stored hashes."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY
from typer.testing import CliRunner, Result

from schemas import AuditEvent, Tier
from seawall.keys import keys_app
from seawall_client.topics import RedisKeys, Topics
from services.common.bus import make_consumer
from services.common.settings import CommonSettings
from services.ingress.keystore import KeyRecordRefused
from services.ingress.service import IngressService
from tests.integration.ingress.conftest import Keys, new_key

pytestmark = pytest.mark.integration

# Every read goes to Redis here, unless a test says otherwise: what is tampered with
# is refused on the next request, not after the cache's 2 s.
NO_CACHE = pytest.mark.parametrize("ingress", [{"key_cache_s": 0}], indirect=True)


def key_id_of(key: str) -> str:
    return key.split("_")[0].removeprefix("sk-sw-")


def record_key(ingress: IngressService, key: str) -> str:
    return RedisKeys(ingress.settings.redis_prefix).api_key(key_id_of(key))


def policy_key(ingress: IngressService, tenant: str) -> str:
    return f"{ingress.settings.redis_prefix}tenant:{{{tenant}}}:policy"


async def models(client: httpx.AsyncClient, key: str) -> httpx.Response:
    """``GET /v1/models``: the whole authentication (key record, lifecycle, policy)."""
    return await client.get("/v1/models", headers=Keys.auth(key))


def refusals(record: str, reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "seawall_ingress_record_integrity_failures_total", {"record": record, "reason": reason}
    )
    return value or 0.0


def code(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


@NO_CACHE
async def test_a_legitimate_key_authenticates_and_its_records_carry_a_mac(
    ingress: IngressService, client: httpx.AsyncClient, keys: Keys, redis: aioredis.Redis
) -> None:
    assert (await models(client, keys.pro)).status_code == 200
    record = await redis.hgetall(record_key(ingress, keys.pro))
    policy = await redis.hgetall(policy_key(ingress, "pro-co"))
    assert len(record[b"mac"]) == len(policy[b"mac"]) == 64
    assert record[b"mac"] != policy[b"mac"]


@NO_CACHE
async def test_a_record_moved_to_another_tenant_is_refused_like_an_unknown_key(
    ingress: IngressService,
    client: httpx.AsyncClient,
    keys: Keys,
    redis: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = refusals("key", "mismatch")
    await redis.hset(record_key(ingress, keys.basic), "tenant", "big-co")  # enterprise
    with caplog.at_level(logging.WARNING, logger="services.ingress.keystore"):
        answers = [await models(client, keys.basic) for _ in range(3)]
    assert [code(a) for a in answers] == [(401, "invalid_api_key")] * 3
    assert refusals("key", "mismatch") - before == 3  # every read refused is counted
    warnings = [r for r in caplog.records if "integrity check" in r.getMessage()]
    assert len(warnings) == 1  # logged once per key id
    assert getattr(warnings[0], "key_id", None) == key_id_of(keys.basic)
    assert (await models(client, keys.pro)).status_code == 200  # the others are unaffected


@NO_CACHE
async def test_a_revocation_cleared_in_redis_does_not_revive_the_key(
    ingress: IngressService, client: httpx.AsyncClient, keys: Keys, redis: aioredis.Redis
) -> None:
    await ingress.keystore.revoke(key_id_of(keys.pro))
    # the revocation's own record verifies: refused for what it says, not for its MAC
    assert code(await models(client, keys.pro)) == (401, "key_revoked")
    await redis.hdel(record_key(ingress, keys.pro), "revoked_at")
    assert code(await models(client, keys.pro)) == (401, "invalid_api_key")
    # nor does moving the key's creation date (to push it out of a retired phase)
    await redis.hset(record_key(ingress, keys.basic), "created_at", repr(time.time() + 86_400))
    assert code(await models(client, keys.basic)) == (401, "invalid_api_key")


@NO_CACHE
async def test_a_tier_changed_in_redis_refuses_the_tenant(
    ingress: IngressService, client: httpx.AsyncClient, keys: Keys, redis: aioredis.Redis
) -> None:
    before = refusals("policy", "mismatch")
    await redis.hset(policy_key(ingress, "basic-co"), "tier", Tier.ENTERPRISE.value)
    assert code(await models(client, keys.basic)) == (403, "tenant_unknown")
    assert refusals("policy", "mismatch") - before == 1
    # the sensitive-data policy is covered too (a tenant's "block" relaxed to "redact")
    await redis.hset(policy_key(ingress, "careful-co"), "sensitive", "redact")
    assert code(await models(client, keys.blocking)) == (403, "tenant_unknown")
    # an operator setting the tier again writes a signed policy: the tenant is back
    await ingress.keystore.set_policy("basic-co", tier=Tier.BASIC)
    assert (await models(client, keys.basic)).status_code == 200


@NO_CACHE
async def test_a_region_changed_added_or_removed_in_redis_refuses_the_tenant(
    ingress: IngressService, client: httpx.AsyncClient, keys: Keys, redis: aioredis.Redis
) -> None:
    """The region decides which regional throttles hold a tenant's Kafka requests back:
    moving a tenant out of a throttled region (or into another's) in Redis is refused
    like a raised tier."""
    store = ingress.keystore
    policy = await store.set_policy("pro-co", region="ap-east")
    assert policy.region == "ap-east"
    assert (await store.policy("pro-co")) == policy
    assert (await models(client, keys.pro)).status_code == 200
    key = policy_key(ingress, "pro-co")
    assert await redis.hget(key, "region") == b"ap-east"
    before = refusals("policy", "mismatch")
    await redis.hset(key, "region", "eu-west")  # changed
    assert code(await models(client, keys.pro)) == (403, "tenant_unknown")
    await redis.hdel(key, "region")  # removed: "from no region", which no throttle names
    assert code(await models(client, keys.pro)) == (403, "tenant_unknown")
    assert refusals("policy", "mismatch") - before == 2
    # added to a policy that had none
    assert (await store.policy("big-co")) is not None
    await redis.hset(policy_key(ingress, "big-co"), "region", "eu-west")
    assert code(await models(client, keys.enterprise)) == (403, "tenant_unknown")
    # the operator setting it again writes a signed policy; clearing it ("") leaves no
    # field behind that the MAC does not cover
    await store.set_policy("pro-co", tier=Tier.PRO, region="ap-east")
    assert (await models(client, keys.pro)).status_code == 200
    cleared = await store.set_policy("pro-co", region="")
    assert cleared.region is None
    assert b"region" not in await redis.hgetall(key)
    assert (await models(client, keys.pro)).status_code == 200
    assert (await store.policy("pro-co")) == cleared
    with pytest.raises(ValueError, match="region"):
        await store.set_policy("pro-co", region="has{braces}")


@NO_CACHE
async def test_macs_swapped_between_two_records_verify_neither(
    ingress: IngressService, client: httpx.AsyncClient, keys: Keys, redis: aioredis.Redis
) -> None:
    second = await new_key(ingress.keystore, "pro-co", Tier.PRO)
    a, b = record_key(ingress, keys.pro), record_key(ingress, second)
    mac_a, mac_b = await redis.hget(a, "mac"), await redis.hget(b, "mac")
    assert mac_a is not None
    assert mac_b is not None
    await redis.hset(a, "mac", mac_b)
    await redis.hset(b, "mac", mac_a)
    # and a policy's MAC copied onto another tenant's identical policy
    enterprise, careful = policy_key(ingress, "big-co"), policy_key(ingress, "careful-co")
    await redis.hset(
        careful, mapping={"sensitive": "redact", "mac": await redis.hget(enterprise, "mac") or b""}
    )
    assert code(await models(client, keys.pro)) == (401, "invalid_api_key")
    assert code(await models(client, second)) == (401, "invalid_api_key")
    assert code(await models(client, keys.blocking)) == (403, "tenant_unknown")
    assert (await models(client, keys.enterprise)).status_code == 200


@NO_CACHE
async def test_rotation_and_revocation_write_records_that_verify(
    ingress: IngressService, client: httpx.AsyncClient, keys: Keys, redis: aioredis.Redis
) -> None:
    store = ingress.keystore
    old, issued = await store.rotate(key_id_of(keys.pro))
    grace = await models(client, keys.pro)  # the old key: its grace period
    assert grace.status_code == 200
    assert "Sunset" in grace.headers
    assert (await models(client, issued.key)).status_code == 200
    assert await store.get(old.key_id) == old  # rotated_at is covered and verifies
    await store.revoke(issued.record.key_id)
    assert code(await models(client, issued.key)) == (401, "key_revoked")
    stored = await redis.hgetall(record_key(ingress, issued.key))
    assert set(stored) == {
        b"tenant",
        b"key_hash",
        b"signing_key",
        b"created_at",
        b"revoked_at",
        b"mac",
    }


async def test_a_cached_record_was_checked_when_it_was_read(
    ingress: IngressService,
    client: httpx.AsyncClient,
    keys: Keys,
    redis: aioredis.Redis,
) -> None:
    """With the cache on (2 s): a tampered record is refused, and the refusal is what is
    cached — one Redis read, one count, for requests that keep coming."""
    assert ingress.settings.key_cache_s == 2.0
    before = refusals("key", "mismatch")
    await redis.hset(record_key(ingress, keys.basic), "tenant", "pro-co")
    answers = [await models(client, keys.basic) for _ in range(3)]
    assert [code(a) for a in answers] == [(401, "invalid_api_key")] * 3
    assert refusals("key", "mismatch") - before == 1
    assert (await models(client, keys.pro)).status_code == 200


# -- records written before records were signed ------------------------------------


def cli_env(ingress: IngressService, settings: CommonSettings) -> dict[str, str]:
    return {
        "SEAWALL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "SEAWALL_KAFKA_IDEMPOTENCE": str(settings.kafka_idempotence).lower(),
        "SEAWALL_REDIS_URL": settings.redis_url,
        "SEAWALL_REDIS_PREFIX": settings.redis_prefix,
        "SEAWALL_TOPIC_PREFIX": settings.topic_prefix,
        "SEAWALL_CONTROL_KEYS_DIR": str(settings.control_keys_dir),
        "SEAWALL_KEY_PEPPER": ingress.settings.pepper.decode(),
        "COLUMNS": "200",
    }


async def sign(env: dict[str, str], *args: str) -> Result:
    """``seawall keys sign ...`` in a thread: the command runs its own event loop."""
    return await asyncio.to_thread(lambda: CliRunner().invoke(keys_app, ["sign", *args], env=env))


async def signed_audit(settings: CommonSettings, topics: Topics) -> list[AuditEvent]:
    consumer = make_consumer(settings, topics.audit, group_id=None)
    await consumer.start()
    events: list[AuditEvent] = []
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                events += [AuditEvent.model_validate_json(r.value) for r in records]
            if len([e for e in events if e.action == "record_signed"]) >= 2:
                break
    finally:
        await consumer.stop()
    return [e for e in events if e.action == "record_signed"]


@NO_CACHE
async def test_unsigned_records_are_refused_until_seawall_keys_sign_signs_them(
    ingress: IngressService,
    client: httpx.AsyncClient,
    keys: Keys,
    redis: aioredis.Redis,
    settings: CommonSettings,
    topics: Topics,
) -> None:
    """An older version's records (the same hashes, no ``mac``) are refused; ``seawall
    keys sign`` signs exactly those — never a record whose MAC is wrong — audits each,
    and then they work. ``--dry-run`` changes nothing."""
    before = refusals("key", "unsigned")
    legacy = await new_key(ingress.keystore, "old-co", Tier.PRO)
    await redis.hdel(record_key(ingress, legacy), "mac")
    await redis.hdel(policy_key(ingress, "old-co"), "mac")
    await redis.hset(record_key(ingress, keys.basic), "tenant", "old-co")  # altered
    assert code(await models(client, legacy)) == (401, "invalid_api_key")
    assert refusals("key", "unsigned") - before == 1
    with pytest.raises(KeyRecordRefused):  # the CLI's revoke and rotate say why
        await ingress.keystore.revoke(key_id_of(legacy))

    env = cli_env(ingress, settings)
    dry = await sign(env, "--dry-run", "--json")
    assert dry.exit_code == 1, dry.output  # a record is left refused: the altered one
    planned = json.loads(dry.stdout)
    assert [k["key_id"] for k in planned["keys"]] == [key_id_of(legacy)]
    assert planned["policies"] == [{"tenant": "old-co", "tier": "pro", "sensitive": "redact"}]
    assert planned["altered"] == [{"record": "key", "name": key_id_of(keys.basic)}]
    assert not await redis.hexists(record_key(ingress, legacy), "mac")

    done = await sign(env)
    assert done.exit_code == 1, done.output
    assert f"signed key {key_id_of(legacy)} of tenant old-co" in done.stdout
    assert f"wrong MAC (altered?): key {key_id_of(keys.basic)}" in done.stderr
    assert (await models(client, legacy)).status_code == 200
    assert code(await models(client, keys.basic)) == (401, "invalid_api_key")  # still
    assert await redis.ttl(record_key(ingress, legacy)) > 0  # its expiry kept
    events = await signed_audit(settings, topics)
    assert {(e.tenant, e.key_id, e.detail["record"]) for e in events} == {
        ("old-co", None, "policy"),
        ("old-co", key_id_of(legacy), "key"),
    }

    again = await sign(env, "--json")  # nothing left to sign; the altered one stays
    assert json.loads(again.stdout)["keys"] == []
    assert json.loads(again.stdout)["altered"] == planned["altered"]
