"""A request makes progress or is given up — the worker on the real broker and Redis,
with a simulated engine that hangs (``SEAWALL_SIM_HANG_AFTER_S``) or is merely slow:

- an engine that produces nothing for any of its requests for ``engine_stall_s`` fails
  the worker (its supervisor restarts it with a fresh engine), and says so in its
  telemetry meanwhile (``EngineStats.stalled_s``, the controller's breaker row);
- one request with no output for ``request_stall_s`` is answered ``no_progress``;
- a request whose deadline passes while it generates is stopped and answered
  ``expired``;
- a redelivered request that waits for another worker's live lease stops waiting at
  its deadline.
"""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from schemas import EngineStats, ReasonCode, ReplyStatus, RequestCompleted, WorkerReport
from seawall_client.serde import COMPLETION, TELEMETRY, decode
from seawall_client.topics import RedisKeys, Topics
from services.common.bus import make_consumer
from services.common.settings import CommonSettings
from services.workers.claims import Claimed, Claims
from services.workers.engine.base import EngineError
from tests.fleet import (
    ReplyReader,
    dispatched,
    produce,
    sim_worker,
    until,
    worker_settings,
)

pytestmark = pytest.mark.integration


async def reported_stall(
    settings: CommonSettings, topics: Topics, at_least_s: float
) -> EngineStats:
    """The first ``EngineStats`` on the telemetry topic reporting a stall that long."""
    consumer = make_consumer(settings, topics.telemetry, group_id=None)
    await consumer.start()
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                for r in records:
                    msg = decode(TELEMETRY, r.value)
                    parts = msg.parts() if isinstance(msg, WorkerReport) else (msg,)
                    for part in parts:
                        if isinstance(part, EngineStats) and part.stalled_s >= at_least_s:
                            return part
    finally:
        await consumer.stop()
    raise AssertionError(f"no EngineStats reported a stall of {at_least_s} s")


async def test_a_hung_engine_fails_its_worker_and_shows_in_its_telemetry(
    settings: CommonSettings, topics: Topics
) -> None:
    ws = worker_settings(
        settings, sim_hang_after_s=0.0, engine_stall_s=3.0, telemetry_interval_s=0.2
    )
    async with sim_worker(ws) as worker, ReplyReader(settings, topics) as client:
        started = time.monotonic()
        await produce(settings, topics.dispatch("main"), [dispatched(1, client.topic)])
        stalled = await reported_stall(settings, topics, at_least_s=1.0)
        await until(worker.failed.is_set, 15)
        failed_after = time.monotonic() - started
    assert stalled.in_flight == 1
    assert isinstance(worker.failure, EngineError)
    assert "produced no token" in str(worker.failure)
    assert 3.0 <= failed_after < 10.0
    assert client.terminals == {}  # nothing answered: the next owner serves it


async def test_a_request_with_no_progress_is_given_up_and_the_worker_carries_on(
    settings: CommonSettings, topics: Topics
) -> None:
    ws = worker_settings(settings, sim_hang_after_s=0.0, request_stall_s=1.0)
    async with sim_worker(ws) as worker, ReplyReader(settings, topics) as client:
        started = time.monotonic()
        await produce(settings, topics.dispatch("main"), [dispatched(1, client.topic)])
        await client.wait_terminals(1, timeout_s=20)
        answered_after = time.monotonic() - started
        assert not worker.failed.is_set()
    (reply,) = client.terminals["req-1"]
    assert (reply.status, reply.reason, reply.code) == (
        ReplyStatus.ERROR,
        ReasonCode.ENGINE_ERROR,
        "no_progress",
    )
    assert answered_after < 10.0
    assert worker.engine.snapshot().running == 0  # aborted in the engine


async def test_a_deadline_passing_while_generating_stops_the_request(
    settings: CommonSettings, topics: Topics
) -> None:
    # A slow engine: 400 tokens take far longer than the request's 1.5 s.
    ws = worker_settings(settings, sim_time_scale=5.0)
    async with sim_worker(ws) as worker, ReplyReader(settings, topics) as client:
        started = time.monotonic()
        slow = dispatched(1, client.topic, max_tokens=400, deadline_in_s=1.5)
        await produce(settings, topics.dispatch("main"), [slow])
        await client.wait_terminals(1, timeout_s=20)
        answered_after = time.monotonic() - started
    (reply,) = client.terminals["req-1"]
    assert (reply.status, reply.reason) == (ReplyStatus.EXPIRED, ReasonCode.DEADLINE_EXCEEDED)
    assert 0 < reply.completion_tokens < 400  # what it used until then, for its correction
    assert answered_after < 6.0
    assert worker.engine.snapshot().running == 0


async def test_a_redelivery_waiting_for_another_workers_lease_stops_at_its_deadline(
    settings: CommonSettings, topics: Topics, redis: aioredis.Redis
) -> None:
    ws = worker_settings(settings)
    request = None
    async with sim_worker(ws), ReplyReader(settings, topics) as client:
        request = dispatched(1, client.topic, deadline_in_s=2.0)
        # Another worker holds it, alive, with a lease far past the deadline.
        other = Claims(redis, RedisKeys(settings.redis_prefix), "w-other", lease_s=120.0)
        claim = await other.claim(request.request.tenant, request.request.request_id, 300.0)
        assert isinstance(claim, Claimed)
        started = time.monotonic()
        await produce(settings, topics.dispatch("main"), [request])
        await client.wait_terminals(1, timeout_s=20)
        answered_after = time.monotonic() - started
    (reply,) = client.terminals["req-1"]
    assert (reply.status, reply.reason) == (ReplyStatus.EXPIRED, ReasonCode.DEADLINE_EXCEEDED)
    assert answered_after < 6.0


async def test_a_copy_of_a_request_already_answered_is_reported_as_a_repeat(
    settings: CommonSettings, topics: Topics
) -> None:
    """Admission restarted re-dispatches what it had not committed. The worker answers
    the copy of a request it already answered with nothing (the caller has its reply)
    and a ``RequestCompleted`` marked ``repeat``: the dispatching admission frees that
    copy's slot, for which no completion will ever come."""
    async with sim_worker(worker_settings(settings)), ReplyReader(settings, topics) as client:
        request = dispatched(1, client.topic, max_tokens=4)
        await produce(settings, topics.dispatch("main"), [request])
        await client.wait_terminals(1)
        await produce(settings, topics.dispatch("main"), [request])  # the copy
        completions = await completions_on(settings, topics, 2)
        for _ in range(5):
            await client.poll(100)
    assert len(client.terminals["req-1"]) == 1  # the caller is answered once
    real, repeat = completions
    assert (real.repeat, real.completion_tokens, real.seq) == (False, 4, 1)
    assert (repeat.repeat, repeat.completion_tokens, repeat.seq) == (True, 0, 0)
    assert repeat.request_id == "req-1"


async def completions_on(
    settings: CommonSettings, topics: Topics, n: int
) -> list[RequestCompleted]:
    consumer = make_consumer(settings, topics.completions, group_id=None)
    await consumer.start()
    found: list[RequestCompleted] = []
    try:
        deadline = time.monotonic() + 30
        while len(found) < n:
            assert time.monotonic() < deadline, f"{len(found)} of {n} completions"
            for records in (await consumer.getmany(timeout_ms=200)).values():
                found += [decode(COMPLETION, r.value) for r in records]
    finally:
        await consumer.stop()
    return found
