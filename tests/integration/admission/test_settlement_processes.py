"""Admission replicas restarted mid-backlog — one stopped with SIGTERM, one killed with
SIGKILL — in front of a real worker (simulated engine) on the real broker and Redis:
every request is answered, and the tokens the tenant's bucket lost are exactly those
its requests used (``corrections``: a charge made once, corrected once, refunded only
when the request will never run).

Before, a stop refunded the requests waiting in its backlog but kept their charge
markers: their next owner replayed the charge for free, and their completions found
nothing to correct — every one of them ran on tokens nobody paid."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from schemas import Priority, ReplyStatus, Tier
from seawall_client.topics import RedisKeys, Topics
from services.admission.quota import quota_key
from services.common.settings import CommonSettings
from tests.admission_helpers import inference_request, send_all, started
from tests.fleet import ReplyReader, sim_worker, spawn_service, worker_settings

pytestmark = pytest.mark.integration

TENANT = "steady-co"
N = 120
CAPACITY = 1e9
QUOTA = {
    "requests": {"capacity": 1e6, "rate": 0.001},
    "tokens": {"capacity": CAPACITY, "rate": 0.001},
}


def spawn(settings: CommonSettings, name: str, log: Path) -> subprocess.Popen[bytes]:
    return spawn_service(
        settings,
        "services.admission",
        name,
        log,
        SEAWALL_LOG_FORMAT="json",
        SEAWALL_COMMIT_INTERVAL_S="0.2",
        SEAWALL_QUOTA_PRO=json.dumps(QUOTA),
    )


async def test_tokens_charged_match_the_tokens_used_across_admission_restarts(
    settings: CommonSettings, topics: Topics, redis: aioredis.Redis, tmp_path: Path
) -> None:
    procs = [spawn(settings, f"adm-{i}", tmp_path / f"adm-{i}.log") for i in range(2)]
    restarts = 0
    try:
        async with (
            started(worker := sim_worker(worker_settings(settings, batch_limit=4))),
            ReplyReader(settings, topics) as client,
        ):
            requests = [
                inference_request(
                    f"s{i}", client.topic, tenant=TENANT, tier=Tier.PRO, max_tokens=12
                ).model_copy(update={"session_id": uuid.uuid4().hex})
                for i in range(N)
            ]
            await send_all(settings, topics.requests(Priority.STANDARD), requests)
            deadline = time.monotonic() + 150
            # A stop, then a kill, each while most of the backlog still waits.
            for at, sig in ((N // 5, signal.SIGTERM), (2 * N // 5, signal.SIGKILL)):
                while len(client.terminals) < at:
                    assert time.monotonic() < deadline, f"{len(client.terminals)} answered"
                    await client.poll(100)
                victim = restarts % 2
                procs[victim].send_signal(sig)
                # Waited on off the event loop: the worker in it must go on serving.
                await asyncio.to_thread(procs[victim].wait, 30)
                restarts += 1
                procs[victim] = spawn(settings, f"adm-{victim}", tmp_path / f"adm-{victim}.log")
            while len(client.terminals) < N:
                assert not worker.failed.is_set(), worker.failure
                assert time.monotonic() < deadline, f"{len(client.terminals)} of {N} answered"
                await client.poll(100)
            # Every completion settled: no reservation of the tenant's is left.
            keys = RedisKeys(settings.redis_prefix)
            reservations = [keys.reservation(TENANT, r.request_id) for r in requests]
            while await redis.exists(*reservations):
                assert time.monotonic() < deadline, "completions not settled"
                await asyncio.sleep(0.2)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()

    assert restarts == 2
    used = 0
    for r in requests:
        reply = client.terminals[r.request_id][0]
        assert reply.status is ReplyStatus.OK, reply
        used += reply.prompt_tokens + reply.completion_tokens
    level = await redis.hget(quota_key(settings.redis_prefix, TENANT, "tokens"), "tokens")
    assert level is not None
    print(f"\n{N} requests used {used} tokens; the bucket lost {CAPACITY - float(level):.1f}")
    assert CAPACITY - float(level) == pytest.approx(used, abs=1.0)


async def test_a_completion_written_before_the_group_ever_committed_is_settled(
    settings: CommonSettings, topics: Topics, redis: aioredis.Redis
) -> None:
    """A completion written while admission's completions group has no committed offset
    (its first member killed before committing, or not yet joined) is still settled by
    the next member: the group starts from the earliest record, not the latest (a CI
    run of the test above left reservations unsettled that way)."""
    from schemas import RequestCompleted
    from seawall_client.kafka import ensure_topics
    from services.admission.service import Admission
    from tests.admission_helpers import admission_settings
    from tests.fleet import produce

    await ensure_topics(settings.kafka, topics.specs())
    reservation = RedisKeys(settings.redis_prefix).reservation(TENANT, "early-1")
    await redis.set(reservation, "100d", ex=600)  # charged 100, a copy sent for dispatch
    done = RequestCompleted(
        worker_id="w-1",
        pool="main",
        request_id="early-1",
        tenant=TENANT,
        priority=Priority.STANDARD,
        tier=Tier.PRO,
        queue_wait_ms=1.0,
        latency_ms=10.0,
        prompt_tokens=30,
        completion_tokens=20,
        at=time.time(),
    )
    await produce(settings, topics.completions, [done])  # before admission ever ran
    async with Admission(admission_settings(settings)):

        async def settled() -> bool:
            return not await redis.exists(reservation)

        deadline = time.monotonic() + 30
        while not await settled():
            assert time.monotonic() < deadline, "the completion was skipped, not settled"
            await asyncio.sleep(0.2)
