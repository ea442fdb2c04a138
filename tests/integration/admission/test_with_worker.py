"""Admission in front of a real worker (simulated engine) on the real broker and Redis:
priority decided in admission, not in a queue behind the GPU, measured by counting
dispatch records; and the token reservation corrected from the completion."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from schemas import DegradationLevel, Priority, ReplyStatus, Tier
from seawall_client.serde import DISPATCH, decode
from seawall_client.topics import RedisKeys, Topics
from services.admission.policy.scheduler import SchedulerConfig
from services.admission.quota import quota_key
from services.admission.service import Admission
from services.common.bus import topics_of
from services.common.settings import CommonSettings
from tests.admission_helpers import (
    TopicReader,
    admission_settings,
    apply_control,
    control_common,
    inference_request,
    send_all,
    started,
)
from tests.fleet import ReplyReader, sim_worker, until, worker_settings

BATCH_LIMIT = 4
SLACK = 1
BULK, VIP = 40, 64
"""Enough VIP work that bulk's guaranteed share of the dispatches while VIP waits (more
than 64 × 5 % − 2 = 1.2) is at least one, so "bulk progressed" follows from the
scheduler's floor, not from how the VIP requests happened to spread over rounds."""
ROOMY = {
    "quota_basic": {"requests": {"capacity": 1000}, "tokens": {"capacity": 1e9, "rate": 1e6}},
    "quota_enterprise": {"requests": {"capacity": 1000}},
}


async def test_vip_overtakes_a_saturating_bulk_backlog(settings: CommonSettings) -> None:
    # One partition per topic: the dispatch topic's offsets are the dispatch order.
    one = settings.model_copy(
        update={"topic_prefix": f"{settings.topic_prefix}p1.", "topic_partitions": 1}
    )
    topics = topics_of(one)
    dispatch = topics.dispatch("main")
    admission = Admission(admission_settings(one, pacing_slack=SLACK, **ROOMY))
    async with (
        started(sim_worker(worker_settings(one, batch_limit=BATCH_LIMIT)), admission),
        ReplyReader(one, topics) as client,
        TopicReader(one, dispatch) as reader,
    ):
        bulk = [
            inference_request(f"bulk-{i}", client.topic, tenant="bulk-co", tier=Tier.BASIC)
            for i in range(BULK)
        ]
        await send_all(one, topics.requests(Priority.BULK), bulk)
        # the pool is saturated and the rest of the bulk work waits in admission
        await reader.until(dispatch, BATCH_LIMIT + SLACK)
        await until(lambda: admission.backlog(Priority.BULK) > BULK // 2)
        vip = [
            inference_request(f"vip-{i}", client.topic, tenant="vip-co", tier=Tier.ENTERPRISE)
            for i in range(VIP)
        ]
        await send_all(one, topics.requests(Priority.VIP), vip)
        await client.wait_terminals(BULK + VIP, timeout_s=120)
        await reader.until(dispatch, BULK + VIP)

    order = [decode(DISPATCH, raw).request.request_id.split("-")[0] for raw in reader.raw[dispatch]]
    assert sorted(order) == sorted(["bulk"] * BULK + ["vip"] * VIP)  # each dispatched once
    assert all(r[0].status is ReplyStatus.OK for r in client.terminals.values())

    first_vip = order.index("vip")
    last_vip = len(order) - 1 - order[::-1].index("vip")
    window = order[first_vip : last_vip + 1]  # dispatches while VIP work was waiting
    n, vips = len(window), window.count("vip")
    bulk_in_window = n - vips
    bulk_after = order[last_vip + 1 :].count("bulk")
    print(
        f"\nfirst VIP at dispatch #{first_vip} (bulk still waiting: {BULK - first_vip}); "
        f"window of {n}: {vips} VIP, {bulk_in_window} bulk; bulk after the last VIP: {bulk_after}"
    )
    # When VIP work arrived most of the bulk backlog was still in admission, not queued
    # on the dispatch topic in front of it; VIP then went ahead of that backlog.
    assert BULK - first_vip >= BULK // 2
    assert bulk_after >= bulk_in_window
    assert vips >= 2 * bulk_in_window
    # VIP at least its floor; bulk kept its minimum share (the scheduler's guarantee:
    # more than N × share − 2 of any N dispatches while a class has work) and progressed.
    policies = SchedulerConfig().policies
    assert vips > n * policies[Priority.VIP].min_share - 2
    assert bulk_in_window > n * policies[Priority.BULK].min_share - 2
    assert bulk_in_window >= 1


async def test_the_reservation_is_corrected_from_the_completion(
    settings: CommonSettings, topics: Topics, redis: aioredis.Redis
) -> None:
    capacity = 10_000
    quota = {"quota_enterprise": {"tokens": {"capacity": capacity, "rate": 0.001}}}
    admission = Admission(admission_settings(settings, **quota))
    async with (
        started(sim_worker(worker_settings(settings)), admission),
        ReplyReader(settings, topics) as client,
    ):
        capped = DegradationLevel(**control_common("pool:main", 1), level=2, max_tokens_cap=8)
        await apply_control(settings, topics, admission.control, capped)
        req = inference_request("long", client.topic, tier=Tier.ENTERPRISE, max_tokens=500)
        await send_all(settings, topics.requests(Priority.VIP), [req])
        await client.wait_terminals(1)
        key = RedisKeys(settings.redis_prefix).reservation(req.tenant, req.request_id)
        deadline = time.monotonic() + 20
        while await redis.exists(key):
            assert time.monotonic() < deadline, "the completion was not settled"
            await client.poll(50)

    (reply,) = client.terminals["long"]
    assert reply.completion_tokens == 8  # truncated by degradation level 2
    actual = reply.prompt_tokens + reply.completion_tokens
    left = await redis.hget(quota_key(settings.redis_prefix, req.tenant, "tokens"), "tokens")
    assert left is not None
    # reserved prompt + 500 at admission, corrected to what was really used
    assert float(left) == pytest.approx(capacity - actual, abs=0.5)
