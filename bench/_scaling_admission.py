"""Part 2 of the scaling benchmark: admission's quota path and Redis memory against
tenants.

On the local Redis, under a prefix of its own whose keys are deleted at the end (and
checked gone). For ``T`` tenants:

1. each tenant's ingress records — policy, one API key (its hash, with the keystore's
   expiry), its key set, its place in the tenants set — written in the layout of
   ``services/ingress/keystore.py``, pipelined (the layout is checked in the same run
   against a tenant made by ``KeyStore.create`` itself);
2. rounds of ``RedisQuota.decide_many`` — admission's quota call, one EVALSHA of
   ``bucket.lua`` per request, pipelined per intake batch of 200, one round at a time as
   one admission process's intake does — taking the tenants in turn until every tenant
   decided once and ``--decide-s`` passed. Limits are set high, so every decision admits
   and writes both of its tenant's bucket hashes (the dearer path). Decisions per second
   = decisions / that time. This is the quota decision path in-process against the real
   Redis, not admission's whole path through the broker (``admission_throughput.py``
   measures that for one tenant mix). Baseline: the same pipelined rounds of a trivial
   EVALSHA through the same client.
3. memory: ``INFO memory`` ``used_memory`` before, after step 1 and after step 2 (the Redis
   is shared with other work: small deltas are noise), and ``MEMORY USAGE`` per kind of
   key, averaged over up to 2,000 tenants (the buckets over the last round's tenants). A
   bucket expires once it would be full again (``bucket.ttl_ms``: time to refill + 1 s):
   within about a second here, within 1–2 s of one request on the default tiers — so
   bucket memory follows the tenants active in the last seconds, not all tenants; the
   number of buckets alive at the end is counted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from _common import control_keys
from aiokafka import AIOKafkaProducer
from rate_limiter import ROOMY

from schemas import Tier
from seawall_client.kafka import ensure_topics
from seawall_client.topics import RedisKeys
from services.admission.policy.bucket import DIMENSIONS, BucketState, ttl_ms
from services.admission.policy.charges import QuotaRequest
from services.admission.quota import RedisQuota, quota_key
from services.admission.settings import AdmissionSettings
from services.common.bus import make_producer, topics_of
from services.common.settings import CommonSettings
from services.ingress.keystore import (
    AuditLog,
    KeyStore,
    TenantPolicy,
    key_record_fields,
    policy_fields,
)
from services.ingress.policy.integrity import RecordMacs
from services.ingress.policy.keys import DEFAULT_POLICY, disabled_at, generate_key

TENANTS = (10, 10_000, 100_000)
INTAKE_BATCH: int = AdmissionSettings.model_fields["intake_batch"].default
MEMORY_SAMPLE_TENANTS = 2_000
SEED_CHUNK = 2_000
PEPPER = b"bench-scaling-pepper"
TIERS = tuple(Tier)


def policy_key(keys: RedisKeys, tenant: str) -> str:
    return f"{keys.prefix}tenant:{{{tenant}}}:policy"


def tenants_key(keys: RedisKeys) -> str:
    return f"{keys.prefix}tenants"


def tenant_names(run: str, count: int) -> list[str]:
    return [f"{run}-t{i}" for i in range(count)]


async def seed_tenants(
    client: aioredis.Redis, keys: RedisKeys, tenants: Sequence[str]
) -> list[str]:
    """Each tenant's ingress records in the keystore's layout, pipelined; returns the key
    ids made."""
    now = time.time()
    macs = RecordMacs.from_pepper(PEPPER)
    key_ids: list[str] = []
    for start in range(0, len(tenants), SEED_CHUNK):
        chunk = tenants[start : start + SEED_CHUNK]
        async with client.pipeline(transaction=False) as pipe:
            pipe.sadd(tenants_key(keys), *chunk)
            for i, tenant in enumerate(chunk, start):
                record = generate_key(tenant, now, PEPPER).record
                key_ids.append(record.key_id)
                api_key = keys.api_key(record.key_id)
                policy = TenantPolicy(TIERS[i % len(TIERS)], "redact")
                pipe.hset(policy_key(keys, tenant), mapping=policy_fields(tenant, policy, macs))
                pipe.sadd(keys.tenant_keys(tenant), record.key_id)
                pipe.hset(api_key, mapping=key_record_fields(record, macs))
                purge_at = disabled_at(record, DEFAULT_POLICY) + DEFAULT_POLICY.retired_s
                pipe.pexpireat(api_key, int(purge_at * 1000))
            await pipe.execute()
    return key_ids


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def layout(client: aioredis.Redis, prefix: str, tenant: str, key_id: str) -> list[str]:
    """Every key under ``prefix``, the tenant and key id replaced by placeholders, with
    its type, hash fields and whether it expires."""
    out = []
    async for raw in client.scan_iter(match=f"{prefix}*", count=1000):
        key = text(raw)
        kind = text(await client.type(key))
        fields = sorted(text(f) for f in await client.hkeys(key)) if kind == "hash" else []
        expires = await client.pttl(key) > 0
        shape = key.replace(tenant, "<tenant>").replace(key_id, "<key id>")
        out.append(f"{shape} {kind} {fields} expires={expires}")
    return sorted(out)


async def check_layout(
    client: aioredis.Redis, producer: AIOKafkaProducer, audit_topic: str
) -> None:
    """The bulk writer must leave what ``KeyStore.create`` leaves (one tenant each)."""
    run = uuid.uuid4().hex[:8]
    real, bulk = RedisKeys(f"bench-scaling-{run}-real:"), RedisKeys(f"bench-scaling-{run}-bulk:")
    store = KeyStore(client, real, PEPPER, AuditLog(producer, audit_topic, "bench-scaling"))
    try:
        issued, _ = await store.create("tenant-a", tier=TIERS[0])
        (key_id,) = await seed_tenants(client, bulk, ["tenant-a"])
        made = await layout(client, real.prefix, "tenant-a", issued.record.key_id)
        written = await layout(client, bulk.prefix, "tenant-a", key_id)
        if [m.removeprefix(real.prefix) for m in made] != [
            w.removeprefix(bulk.prefix) for w in written
        ]:
            raise RuntimeError(
                f"the bulk writer's layout drifted from KeyStore's:\n{made}\n{written}"
            )
    finally:
        for keys in (real, bulk):
            await forget(client, [k async for k in client.scan_iter(match=f"{keys.prefix}*")])


async def forget(client: aioredis.Redis, names: Sequence[str | bytes]) -> None:
    for start in range(0, len(names), 10_000):
        await client.unlink(*names[start : start + 10_000])


async def used_memory(client: aioredis.Redis) -> int:
    info = await client.info("memory")
    return int(info["used_memory"])


async def trivial_rounds(client: aioredis.Redis, seconds: float) -> float:
    """Decisions/s of the baseline: pipelined rounds of a trivial EVALSHA."""
    sha = await client.script_load("return 1")
    done, end = 0, time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < end:
        async with client.pipeline(transaction=False) as pipe:
            for _ in range(INTAKE_BATCH):
                pipe.evalsha(sha, 0)
            await pipe.execute()
        done += INTAKE_BATCH
    return done / (time.perf_counter() - start)


async def tenants_phase(client: aioredis.Redis, count: int, seconds: float) -> dict[str, Any]:
    """Seed ``count`` tenants, then rounds of quota decisions taking the tenants in turn
    until every tenant decided once and at least ``seconds`` passed."""
    run = uuid.uuid4().hex[:8]
    keys = RedisKeys(f"bench-scaling-{run}:")
    tenants = tenant_names(run, count)
    quota = RedisQuota(client, keys.prefix)
    buckets = [quota_key(keys.prefix, t, d) for t in tenants for d in DIMENSIONS]
    names: list[str] = [tenants_key(keys), *buckets]
    try:
        before = await used_memory(client)
        started = time.perf_counter()
        key_ids = await seed_tenants(client, keys, tenants)
        seed_s = time.perf_counter() - started
        names += [keys.api_key(k) for k in key_ids]
        names += [n for t in tenants for n in (policy_key(keys, t), keys.tenant_keys(t))]
        seeded = await used_memory(client)
        outcomes: dict[str, int] = {}
        done, turn = 0, 0
        started = time.perf_counter()
        while done < count or time.perf_counter() - started < seconds:
            batch = [tenants[(turn + i) % count] for i in range(INTAKE_BATCH)]
            turn = (turn + INTAKE_BATCH) % count
            decided = await quota.decide_many([QuotaRequest(t, ROOMY, 1, 430) for t in batch])
            for decision in decided:
                outcomes[decision.outcome] = outcomes.get(decision.outcome, 0) + 1
            done += INTAKE_BATCH
        decide_s = time.perf_counter() - started
        after = await used_memory(client)
        live = sum(
            [await client.exists(*buckets[i : i + 10_000]) for i in range(0, len(buckets), 10_000)]
        )
        per_tenant = await memory_per_tenant(client, keys, tenants, key_ids, batch)
        return {
            "tenants": count,
            "decisions_per_s": done / decide_s,
            "decisions": done,
            "outcomes": outcomes,
            "seed_s": seed_s,
            "used_memory_delta_bytes": after - before,
            "ingress_records_delta_bytes": seeded - before,
            "ingress_records_delta_per_tenant": (seeded - before) / count,
            "buckets_delta_bytes": after - seeded,
            "live_buckets": live,
            "memory_usage_per_tenant": per_tenant,
            "memory_usage_ingress_per_tenant": sum(
                v for k, v in per_tenant.items() if not k.startswith("quota_")
            ),
            "memory_usage_per_tenant_total": sum(per_tenant.values()),
            "all_alive_bytes": sum(per_tenant.values()) * count,
            "keys_written": len(names),
        }
    finally:
        await forget(client, names)
        async for _ in client.scan_iter(match=f"{keys.prefix}*", count=10_000):
            raise RuntimeError(f"keys under {keys.prefix} were left behind")


async def memory_per_tenant(
    client: aioredis.Redis,
    keys: RedisKeys,
    tenants: list[str],
    key_ids: list[str],
    recent: list[str],
) -> dict[str, float]:
    """``MEMORY USAGE`` per kind of key, averaged: the ingress records over up to
    ``MEMORY_SAMPLE_TENANTS`` tenants, the buckets over ``recent`` tenants (their buckets
    are alive: they expire once full again); the tenants set shared out."""
    sample = random.sample(range(len(tenants)), min(len(tenants), MEMORY_SAMPLE_TENANTS))
    wanted = [
        (kind, name)
        for i in sample
        for kind, name in (
            ("policy", policy_key(keys, tenants[i])),
            ("key_set", keys.tenant_keys(tenants[i])),
            ("api_key", keys.api_key(key_ids[i])),
        )
    ]
    wanted += [(f"quota_{d}", quota_key(keys.prefix, t, d)) for t in recent for d in DIMENSIONS]
    async with client.pipeline(transaction=False) as pipe:
        for _, name in wanted:
            pipe.memory_usage(name, samples=0)
        used = await pipe.execute()
    per_kind: dict[str, list[int]] = {}
    for (kind, _), value in zip(wanted, used, strict=True):
        if value is not None:
            per_kind.setdefault(kind, []).append(int(value))
    out = {kind: statistics.fmean(values) for kind, values in per_kind.items()}
    shared = await client.memory_usage(tenants_key(keys), samples=0)
    out["tenants_set_share"] = int(shared or 0) / len(tenants)
    return out


def bucket_ttls_s() -> dict[str, float]:
    """Per default tier: how long its buckets live after one request (430 tokens) taken
    from full — the longer of the two dimensions' TTLs (``bucket.ttl_ms``)."""
    out = {}
    for tier, config in AdmissionSettings(_env_file=None).tier_configs().items():
        ttls = [
            ttl_ms(BucketState(limit.capacity - cost, 0.0, limit.burst_capacity), limit)
            for limit, cost in ((config.requests, 1.0), (config.tokens, 430.0))
        ]
        out[tier.value] = max(ttls) / 1000
    return out


async def admission_part(args: argparse.Namespace, bootstrap: str) -> dict[str, Any]:
    settings = CommonSettings(
        _env_file=None,
        control_keys_dir=control_keys(),
        kafka_bootstrap=bootstrap,
        kafka_idempotence=False,
        topic_prefix=f"bench{uuid.uuid4().hex[:8]}.",
        instance_id="bench-driver",
    )
    client = aioredis.Redis.from_url(settings.redis_url)
    producer = make_producer(settings)
    await producer.start()
    try:
        topics = topics_of(settings)
        await ensure_topics(bootstrap, topics.specs())
        await check_layout(client, producer, topics.audit)
        baseline = await trivial_rounds(client, args.decide_s)
        phases = [await tenants_phase(client, n, args.decide_s) for n in args.tenants]
        version = (await client.info("server"))["redis_version"]
    finally:
        await producer.stop()
        await client.aclose()
    return {
        "trivial_evalsha_per_s": baseline,
        "phases": phases,
        "redis_version": version,
        "default_tier_bucket_ttl_after_one_request_s": bucket_ttls_s(),
    }
