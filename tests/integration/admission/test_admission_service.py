"""Admission on the real broker and Redis: rejections with their rate-limit fields,
expiry and cancellation without dispatch, the Redis-down policy, and control events
changing decisions. Capacity comes from a feed of real telemetry records."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
from aiokafka.errors import KafkaConnectionError
from prometheus_client import REGISTRY

from schemas import (
    BreakerLevel,
    BreakerState,
    Degradation,
    DegradationLevel,
    DispatchedRequest,
    InferenceReply,
    Priority,
    QuotaHint,
    QuotaOverride,
    ReasonCode,
    RegionThrottle,
    ReplyStatus,
    Tier,
)
from seawall_client.topics import RedisKeys, Topics
from services.admission.intake import CHARGES_IN_FLIGHT
from services.admission.quota import quota_key
from services.admission.service import Admission
from services.common.settings import CommonSettings
from tests.admission_helpers import (
    TopicReader,
    admission_settings,
    apply_control,
    capacity_feed,
    control_common,
    inference_request,
    send_all,
)
from tests.fleet import ReplyReader, until

T = TypeVar("T")
TIER_OF = {Priority.VIP: Tier.ENTERPRISE, Priority.STANDARD: Tier.PRO, Priority.BULK: Tier.BASIC}
STRICT = {
    "quota_basic": {"requests": {"capacity": 3, "rate": 0.001}, "tokens": {"rate": 0.001}},
    "quota_pro": {
        "requests": {"capacity": 1, "rate": 0.001, "burst_capacity": 1, "burst_rate": 0.001}
    },
}


async def dispatched_by_id(reader: TopicReader, topics: Topics) -> dict[str, DispatchedRequest]:
    await reader.poll()
    out: dict[str, DispatchedRequest] = {}
    for pool in ("main", "small"):
        for d in reader.dispatched(topics.dispatch(pool)):
            assert d.request.request_id not in out, "dispatched twice"
            out[d.request.request_id] = d
    return out


def only(client: ReplyReader, rid: str) -> InferenceReply:
    (reply,) = client.terminals[rid]
    return reply


async def test_rejections_expiry_and_cancellation(
    settings: CommonSettings, topics: Topics, redis: aioredis.Redis
) -> None:
    s = admission_settings(settings, **STRICT)
    async with (
        Admission(s) as admission,
        ReplyReader(settings, topics) as client,
        TopicReader(settings, topics.dispatch("main"), topics.dispatch("small")) as reader,
        capacity_feed(settings, topics, {"main": 100}),  # no worker for "small"
    ):
        basic = [
            inference_request(f"b{i}", client.topic, tenant="b1", tier=Tier.BASIC) for i in range(5)
        ]
        pro = [inference_request(f"p{i}", client.topic, tenant="p1") for i in range(3)]
        late = inference_request("late", client.topic, deadline_in_s=0.001)
        waits = inference_request("waits", client.topic, pool="small", deadline_in_s=1.0)
        gone = inference_request("gone", client.topic, tenant="c1", tier=Tier.BASIC)
        await redis.set(RedisKeys(settings.redis_prefix).abort("c1", "gone"), 1, ex=60)
        await asyncio.sleep(0.01)
        await send_all(settings, topics.requests(Priority.BULK), [*basic, gone])
        await send_all(settings, topics.requests(Priority.STANDARD), [*pro, late, waits])

        await client.wait_terminals(2 + 1 + 3, timeout_s=30)
        await until(lambda: admission.backlog(Priority.STANDARD) == 0, timeout_s=10)
        await reader.until(topics.dispatch("main"), 3 + 2)
        dispatched = await dispatched_by_id(reader, topics)

    # basic: a strict bucket of 3 (which 3 depends on the partitions' read order); the
    # rest rejected at once, with the figures of the X-RateLimit headers
    basic_ids = {f"b{i}" for i in range(5)}
    assert len(basic_ids & set(dispatched)) == 3
    for rid in basic_ids - set(dispatched):
        reply = only(client, rid)
        assert (reply.status, reply.reason) == (ReplyStatus.REJECTED, ReasonCode.QUOTA_EXCEEDED)
        assert reply.rate_limit is not None
        assert (reply.rate_limit.limit, reply.rate_limit.remaining) == (3, 0)
        assert reply.rate_limit.retry_after_s >= 1
        assert reply.rate_limit.reset_s > 0
    # pro: baseline 1, burst 1 (admitted, quota-degraded), then rejected
    pro_ids = {f"p{i}" for i in range(3)}
    assert sorted(d.degradation.quota_degraded for r, d in dispatched.items() if r in pro_ids) == [
        False,
        True,
    ]
    (refused,) = pro_ids - set(dispatched)
    assert only(client, refused).reason is ReasonCode.QUOTA_EXCEEDED
    assert only(client, refused).rate_limit is not None
    # expired on arrival, and expired while waiting for a pool with no worker
    for rid in ("late", "waits"):
        reply = only(client, rid)
        assert (reply.status, reply.reason) == (ReplyStatus.EXPIRED, ReasonCode.DEADLINE_EXCEEDED)
        assert rid not in dispatched
    # the client's abort marker: cancelled, never dispatched, its tokens given back
    assert only(client, "gone").reason is ReasonCode.CANCELLED
    assert "gone" not in dispatched
    tokens = await redis.hget(quota_key(settings.redis_prefix, "c1", "tokens"), "tokens")
    # full again; a full bucket's key expires within a second (no key is a full bucket)
    full = s.tier_config(Tier.BASIC).tokens.capacity
    assert tokens is None or float(tokens) == pytest.approx(full, abs=0.01)
    assert await redis.exists(quota_key(settings.redis_prefix, "c1", "requests"))
    assert len(dispatched) == 5


async def test_pools_without_work_still_show_their_capacity(
    settings: CommonSettings, topics: Topics
) -> None:
    """A dispatch round measures only the pools it has work for; the gauges of the
    others are refreshed on a timer, so an idle fleet's capacity is still on /metrics."""

    def slots(pool: str) -> float | None:
        return REGISTRY.get_sample_value("seawall_admission_pool_slots", {"pool": pool})

    async with (
        Admission(admission_settings(settings)),
        capacity_feed(settings, topics, {"main": 37, "small": 23}),  # odd: not another test's
    ):
        await until(lambda: slots("main") == 37 and slots("small") == 23, timeout_s=20)


async def test_redis_down_applies_the_per_tier_policy_and_keeps_running(
    settings: CommonSettings, topics: Topics
) -> None:
    s = admission_settings(settings, redis_url="redis://127.0.0.1:1/0", redis_timeout_s=0.2)
    async with (
        Admission(s) as admission,
        ReplyReader(settings, topics) as client,
        TopicReader(settings, topics.dispatch("main")) as reader,
        capacity_feed(settings, topics, {"main": 100}),
    ):
        ent = inference_request("ent", client.topic, tier=Tier.ENTERPRISE)
        pro = inference_request("pro", client.topic, tier=Tier.PRO)
        basic = inference_request("basic", client.topic, tier=Tier.BASIC)
        await send_all(settings, topics.requests(Priority.VIP), [ent])
        await send_all(settings, topics.requests(Priority.STANDARD), [pro])
        await send_all(settings, topics.requests(Priority.BULK), [basic])
        await client.wait_terminals(1)
        await reader.until(topics.dispatch("main"), 2)
        dispatched = await dispatched_by_id(reader, topics)
        assert not admission.failed.is_set()

    assert dispatched["ent"].degradation == Degradation()
    assert dispatched["pro"].degradation == Degradation(quota_degraded=True)
    reply = only(client, "basic")
    assert (reply.status, reply.reason) == (ReplyStatus.REJECTED, ReasonCode.QUOTA_UNAVAILABLE)
    assert reply.rate_limit is not None
    assert reply.rate_limit.retry_after_s == 1


async def test_control_events_change_the_decisions(
    settings: CommonSettings, topics: Topics
) -> None:
    s = admission_settings(settings)
    seq = iter(range(1, 1000))

    def degrade(scope: str, level: int, cap: int | None = None) -> DegradationLevel:
        return DegradationLevel(
            **control_common(scope, next(seq)),
            level=level,
            small_pool="small" if level else None,
            max_tokens_cap=cap,
        )

    async with (
        Admission(s) as admission,
        ReplyReader(settings, topics) as client,
        TopicReader(settings, topics.dispatch("main"), topics.dispatch("small")) as reader,
        capacity_feed(settings, topics, {"main": 100, "small": 100}),
    ):
        sent = 0

        async def submit(*requests: tuple[str, Priority, dict[str, Any]]) -> None:
            """Produce requests, then wait until admission has answered or dispatched all."""
            nonlocal sent
            for cls in Priority:
                batch = [
                    inference_request(rid, client.topic, tier=TIER_OF[cls], **kw)
                    for rid, c, kw in requests
                    if c is cls
                ]
                if batch:
                    await send_all(settings, topics.requests(cls), batch)
            sent += len(requests)

            async def settled() -> bool:
                await client.poll(50)
                return len(await dispatched_by_id(reader, topics)) + len(client.terminals) >= sent

            deadline = time.monotonic() + 30
            while not await settled():
                assert time.monotonic() < deadline, "requests not settled in time"

        ctl = admission.control
        # level 1 on main: non-VIP work goes to the small pool, VIP stays
        await apply_control(settings, topics, ctl, degrade("pool:main", 1))
        await submit(("l1-std", Priority.STANDARD, {}), ("l1-vip", Priority.VIP, {}))
        # level 2 on main: long requests are also capped
        await apply_control(settings, topics, ctl, degrade("pool:main", 2, cap=64))
        await submit(
            ("l2-long", Priority.STANDARD, {"max_tokens": 200}),
            ("l2-short", Priority.STANDARD, {"max_tokens": 16}),
            ("l2-vip", Priority.VIP, {"max_tokens": 200}),
        )
        # the fleet at level 3, main's own level 0: main's wins; small follows the fleet
        await apply_control(settings, topics, ctl, degrade("fleet", 3), degrade("pool:main", 0))
        await submit(
            ("f3-main", Priority.STANDARD, {}), ("f3-small", Priority.STANDARD, {"pool": "small"})
        )
        await apply_control(settings, topics, ctl, degrade("pool:main", 3), degrade("fleet", 0))
        await submit(("l3-vip", Priority.VIP, {}))
        await apply_control(settings, topics, ctl, degrade("pool:main", 0))
        # breaker at level 3 on main: everything for main rejected, small unaffected
        opened = BreakerState(
            **control_common("pool:main", next(seq)), state="open", level=BreakerLevel.REJECT_NEW
        )
        await apply_control(settings, topics, ctl, opened)
        await submit(
            ("b3-std", Priority.STANDARD, {}),
            ("b3-vip", Priority.VIP, {}),
            ("b3-small", Priority.STANDARD, {"pool": "small"}),
        )
        closed = BreakerState(**control_common("pool:main", next(seq)), state="closed")
        await apply_control(settings, topics, ctl, closed)
        # region throttles: suspended, then one request a second
        stop_eu = RegionThrottle(
            **control_common("region:eu", next(seq)), region="eu", rate_per_s=0
        )
        await apply_control(settings, topics, ctl, stop_eu)
        await submit(
            ("r-eu", Priority.STANDARD, {"region": "eu"}),
            ("r-us", Priority.STANDARD, {"region": "us"}),
        )
        slow_eu = RegionThrottle(
            **control_common("region:eu", next(seq)), region="eu", rate_per_s=1
        )
        await apply_control(settings, topics, ctl, slow_eu)
        await submit(*((f"r1-eu-{i}", Priority.STANDARD, {"region": "eu"}) for i in range(3)))
        # a quota override suspending one tenant
        blocked = QuotaOverride(
            **control_common("tenant:t-blocked", next(seq)), tenant="t-blocked", requests_per_s=0
        )
        await apply_control(settings, topics, ctl, blocked)
        await submit(("q-blocked", Priority.STANDARD, {"tenant": "t-blocked"}))

        dispatched = await dispatched_by_id(reader, topics)
        assert not admission.failed.is_set()

    def where(rid: str) -> tuple[str, Degradation]:
        d = dispatched[rid]
        return d.pool, d.degradation

    assert where("l1-std") == ("small", Degradation(level=1, diverted_from="main"))
    assert where("l1-vip") == ("main", Degradation())
    assert where("l2-long") == (
        "small",
        Degradation(level=2, diverted_from="main", max_tokens_cap=64),
    )
    assert where("l2-short") == ("small", Degradation(level=1, diverted_from="main"))
    assert where("l2-vip") == ("main", Degradation(level=2, max_tokens_cap=64))
    assert where("f3-main") == ("main", Degradation())
    assert where("f3-small") == ("small", Degradation(level=3, static_reply=True))
    assert where("l3-vip") == ("main", Degradation(level=3, static_reply=True))
    for rid in ("b3-std", "b3-vip"):
        reply = only(client, rid)
        assert (reply.status, reply.reason) == (ReplyStatus.REJECTED, ReasonCode.BREAKER_OPEN)
        assert reply.rate_limit is not None
        assert reply.rate_limit.retry_after_s == s.breaker_retry_after_s
    assert where("b3-small") == ("small", Degradation())
    assert only(client, "r-eu").reason is ReasonCode.REGION_THROTTLED
    assert where("r-us") == ("main", Degradation())
    eu = [f"r1-eu-{i}" for i in range(3)]
    assert 1 <= sum(rid in dispatched for rid in eu) < 3
    for rid in eu:
        if rid not in dispatched:
            reply = only(client, rid)
            assert reply.reason is ReasonCode.REGION_THROTTLED
            assert reply.rate_limit is not None
            assert reply.rate_limit.limit == 1
    assert only(client, "q-blocked").reason is ReasonCode.QUOTA_EXCEEDED


async def test_an_empty_requests_bucket_is_hinted_and_a_quota_change_clears_the_hint(
    settings: CommonSettings, topics: Topics
) -> None:
    """Admission tells ingress when a tenant's requests bucket is empty (a hint until it
    refills, once per tenant however many it refuses), and tells it to forget that when
    the tenant's quota changes; a re-publication of the same override changes nothing."""
    s = admission_settings(settings, **STRICT)
    async with (
        Admission(s) as admission,
        ReplyReader(settings, topics) as client,
        TopicReader(settings, topics.quota_hints) as hints,
        capacity_feed(settings, topics, {"main": 100}),
    ):
        flood = [
            inference_request(f"h{i}", client.topic, tenant="hinted", tier=Tier.BASIC)
            for i in range(8)
        ]
        await send_all(settings, topics.requests(Priority.BULK), flood)
        await client.wait_terminals(5)  # capacity 3: five refused

        async def published() -> list[QuotaHint]:
            await hints.poll()
            return [QuotaHint.model_validate_json(v) for v in hints.raw[topics.quota_hints]]

        await until_async(lambda: published(), lambda got: len(got) >= 1)
        (hint,) = await published()
        assert hint.tenant == "hinted"
        assert hint.until - hint.issued_at > 100  # refilled at 0.001 request/s
        assert hint.rate_limit.remaining == 0

        raised = QuotaOverride(
            **control_common("tenant:hinted", 1), tenant="hinted", requests_per_s=50, burst=50
        )
        await apply_control(settings, topics, admission.control, raised)
        await until_async(lambda: published(), lambda got: len(got) >= 2)
        again = raised.model_copy(update={"seq": 2})  # a re-publication: same terms
        await apply_control(settings, topics, admission.control, again)
        await asyncio.sleep(1.0)
        cleared = (await published())[1:]
    assert [(h.tenant, h.until == h.issued_at) for h in cleared] == [("hinted", True)]


async def until_async(
    poll: Callable[[], Awaitable[T]], done: Callable[[T], bool], timeout_s: float = 20
) -> None:
    """Poll until ``done`` holds for what ``poll`` returns."""
    deadline = time.monotonic() + timeout_s
    while not done(await poll()):
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.05)


class _BrokerHiccup:
    """The dispatcher's producer, refusing its first ``failures`` batches as a broker
    that is unreachable refuses them (the embedded broker cannot be taken down and
    brought back with its topics, so the outage is played at the producer)."""

    def __init__(self, producer: Any, failures: int) -> None:
        self._producer = producer
        self.failures_left = failures

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    async def send_batch(self, batch: Any, topic: str, *, partition: int) -> Any:
        if self.failures_left > 0:
            self.failures_left -= 1
            raise KafkaConnectionError("the broker is unreachable (played)")
        return await self._producer.send_batch(batch, topic, partition=partition)


async def test_dispatches_the_broker_did_not_take_wait_and_go_out_once_each(
    settings: CommonSettings, topics: Topics
) -> None:
    s = admission_settings(settings)
    async with (
        Admission(s) as admission,
        ReplyReader(settings, topics) as client,
        TopicReader(settings, topics.dispatch("main")) as reader,
        capacity_feed(settings, topics, {"main": 100}),
    ):
        hiccup = _BrokerHiccup(admission._dispatcher._producer, failures=3)
        admission._dispatcher._producer = hiccup  # type: ignore[assignment]
        requests = [
            inference_request(f"r{i}", client.topic, tenant=f"t{i % 3}", tier=Tier.ENTERPRISE)
            for i in range(20)
        ]
        await send_all(settings, topics.requests(Priority.VIP), requests)
        await reader.until(topics.dispatch("main"), 20, timeout_s=60)
        await until(lambda: admission.backlog(Priority.VIP) == 0, timeout_s=10)
        dispatched = await dispatched_by_id(reader, topics)  # asserts: none twice
        assert not admission.failed.is_set()
    assert hiccup.failures_left == 0
    assert set(dispatched) == {f"r{i}" for i in range(20)}
    assert not client.terminals  # nothing was answered instead of dispatched


class _GatedQuota:
    """Admission's quota store, holding its first round of charges until ``opened``: a
    round Redis is slow to answer, for as long as the test likes."""

    def __init__(self, quota: Any) -> None:
        self._quota = quota
        self.opened = asyncio.Event()
        self.rounds = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quota, name)

    async def charge_many(self, charges: Any) -> Any:
        self.rounds += 1
        if self.rounds == 1:
            await self.opened.wait()
        return await self._quota.charge_many(charges)


async def test_reading_goes_on_while_redis_answers_a_bounded_way(
    settings: CommonSettings, topics: Topics
) -> None:
    admission = Admission(admission_settings(settings, intake_batch=5))
    gate = _GatedQuota(admission._intake._quota)
    admission._intake._quota = gate  # type: ignore[assignment]
    async with (
        ReplyReader(settings, topics) as client,
        TopicReader(settings, topics.dispatch("main")) as reader,
        capacity_feed(settings, topics, {"main": 100}),
    ):
        requests = [
            inference_request(f"r{i}", client.topic, tenant=f"t{i % 3}", tier=Tier.ENTERPRISE)
            for i in range(40)
        ]
        # All waiting before admission reads: every read finds a batch at once.
        await send_all(settings, topics.requests(Priority.VIP), requests)
        async with admission:
            # The first round held: the next batch is read and its charges sent...
            await until(lambda: gate.rounds >= 2, timeout_s=30)
            await asyncio.sleep(1.0)
            # ...but no more than CHARGES_IN_FLIGHT rounds travel, and the second,
            # answered, is not judged before the first: nothing is dispatched yet.
            assert gate.rounds == CHARGES_IN_FLIGHT
            await reader.poll()
            assert not reader.dispatched(topics.dispatch("main"))
            gate.opened.set()
            await reader.until(topics.dispatch("main"), 40, timeout_s=60)
            dispatched = await dispatched_by_id(reader, topics)  # asserts: none twice
            assert not admission.failed.is_set()
    assert set(dispatched) == {f"r{i}" for i in range(40)}
    assert not client.terminals
