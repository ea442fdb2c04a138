"""Token settlement on real Redis (``corrections``, ``settle.lua``, ``bucket.lua``): a
charge is made once, corrected once, refunded only when the request will never run.

Hypothesis plays admission's part against real Redis: requests produced once or twice,
their copies read and charged, dropped by rebalances and stops (redelivered later),
refused (refunded) or sent, and completed by a worker once — in any order. Whatever the
order, the tokens the tenant's bucket lost are those the served requests used, as the
pure bucket model charges them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from aiokafka import ConsumerRecord, TopicPartition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import Priority, RequestCompleted, Tier
from seawall_client.clock import SystemClock
from seawall_client.serde import encode
from seawall_client.topics import RedisKeys
from services.admission.backlog import Waiting
from services.admission.corrections import CompletionsHandler, Corrections
from services.admission.policy.bucket import BucketState, Limit, TierConfig, take
from services.admission.policy.charges import Charge, QuotaRequest
from services.admission.policy.config import PolicyConfig
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.policy.outcomes import Accepted
from services.admission.quota import RedisQuota, quota_key
from services.common.control_state import ControlState
from tests.admission_helpers import inference_request
from tests.integration.admission.test_quota_redis import delete_prefix

pytestmark = pytest.mark.integration

CAPACITY = 1_000_000.0
# Refills a millionth of a token a second: over a test, the level is what was charged.
TOKENS = Limit(CAPACITY, 1e-6)
TIER = TierConfig(Tier.PRO, Limit(1_000_000.0, 1e-6), TOKENS)


@dataclass
class World:
    """Admission's side of the story, as the test drives it."""

    reserve: list[int]
    actual: list[int]
    copies: list[int]
    """How many records carry each request (a producer's retry makes two)."""
    unread: set[tuple[int, int]] = field(default_factory=set)
    waiting: dict[tuple[int, int], Waiting] = field(default_factory=dict)
    sent: set[int] = field(default_factory=set)
    completed: set[int] = field(default_factory=set)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


def waiting(rid: str, copy: int, reserve: int) -> Waiting:
    request = inference_request(rid, "llm.reply.t", tier=Tier.PRO)
    accepted = Accepted("main", Priority.STANDARD, False, float(reserve))
    return Waiting(
        TopicPartition("llm.requests.standard", 0),
        copy,
        request,
        b"",
        Priority.STANDARD,
        accepted,
        time.monotonic(),
    )


steps = st.lists(
    st.tuples(
        st.sampled_from(["read", "read", "drop_all", "refuse", "send", "send", "complete"]),
        st.integers(0, 63),
    ),
    max_size=40,
)
requests = st.lists(
    st.tuples(st.integers(1, 500), st.integers(0, 100), st.integers(1, 2)),
    min_size=1,
    max_size=5,
)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=requests, steps=steps, finish_by_sending=st.lists(st.booleans(), min_size=10))
async def test_tokens_charged_are_the_tokens_of_the_requests_served(
    client: aioredis.Redis,
    requests: list[tuple[int, int, int]],
    steps: list[tuple[str, int]],
    finish_by_sending: list[bool],
) -> None:
    prefix = f"test:{uuid.uuid4().hex}:"
    keys = RedisKeys(prefix)
    quota = RedisQuota(client, prefix)
    pending: list[Coroutine[Any, Any, Any]] = []
    policy = AdmissionPolicy(PolicyConfig({t: TIER for t in Tier}))
    corrections = Corrections(
        client,
        quota,
        keys,
        policy,
        ControlState(),
        {t: TIER for t in Tier},
        SystemClock(),
        pending.append,
    )
    world = World(
        reserve=[r for r, _, _ in requests],
        actual=[r * pct // 100 for r, pct, _ in requests],
        copies=[n for _, _, n in requests],
    )
    world.unread = {(i, c) for i, n in enumerate(world.copies) for c in range(n)}

    async def settle_background() -> None:
        while pending:
            await pending.pop(0)

    async def read(i: int, c: int) -> None:
        rid = f"r{i}"
        life_ms = 600_000
        (charged,) = await quota.charge_many(
            [
                Charge(
                    QuotaRequest("acme", TIER, 1, world.reserve[i]),
                    None,
                    keys.admitted("acme", rid),
                    life_ms,
                    keys.reservation("acme", rid),
                    life_ms,
                )
            ]
        )
        assert charged.tenant.outcome == "admit"
        world.unread.discard((i, c))
        world.waiting[(i, c)] = waiting(rid, c, world.reserve[i])

    async def refuse(key: tuple[int, int]) -> None:
        corrections.refund(world.waiting.pop(key))
        await settle_background()

    async def send(key: tuple[int, int]) -> None:
        corrections.sent([world.waiting.pop(key)])
        await settle_background()
        world.sent.add(key[0])

    async def complete(i: int) -> None:
        # A worker runs a request once (its claim), however many copies were sent.
        await corrections.settle("acme", Tier.PRO, f"r{i}", world.actual[i])
        world.completed.add(i)

    try:
        for op, n in steps:
            if op == "read" and world.unread:
                await read(*sorted(world.unread)[n % len(world.unread)])
            elif op == "drop_all":  # a rebalance or a stop: nothing committed, no refund
                world.unread |= set(world.waiting)
                world.waiting.clear()
            elif op == "refuse" and world.waiting:
                await refuse(sorted(world.waiting)[n % len(world.waiting)])
            elif op == "send" and world.waiting:
                await send(sorted(world.waiting)[n % len(world.waiting)])
            elif op == "complete" and world.sent - world.completed:
                await complete(
                    sorted(world.sent - world.completed)[n % len(world.sent - world.completed)]
                )
        # Every record is read in the end, and each copy sent or refused.
        for i, c in sorted(world.unread):
            await read(i, c)
        for j, key in enumerate(sorted(world.waiting)):
            if finish_by_sending[j % len(finish_by_sending)]:
                await send(key)
            else:
                await refuse(key)
        for i in sorted(world.sent - world.completed):
            await complete(i)

        # The pure model charges each served request what it used, once.
        served = sorted(world.completed)
        state: BucketState | None = None
        for i in served:
            outcome, took = take(state, world.actual[i], 0.0, TOKENS)
            assert outcome == "admit"
            state = took.state
        expected = CAPACITY if state is None else state.tokens
        level = float(await client.hget(quota_key(prefix, "acme", "tokens"), "tokens") or CAPACITY)
        assert level == pytest.approx(expected, abs=0.01), (served, world)
        # Nothing sent is left reserved.
        for i in served:
            assert await client.get(keys.reservation("acme", f"r{i}")) is None
    finally:
        await delete_prefix(client, prefix)


async def test_a_repeat_settles_nothing_the_request_s_own_completion_does(
    client: aioredis.Redis,
) -> None:
    """A worker's ``repeat`` (a copy of a request already answered) arriving before the
    request's own completion must not take its reservation: it would refund everything
    and leave the completion nothing to correct."""
    prefix = f"test:{uuid.uuid4().hex}:"
    keys = RedisKeys(prefix)
    quota = RedisQuota(client, prefix)
    tiers = {t: TIER for t in Tier}
    corrections = Corrections(
        client, quota, keys, AdmissionPolicy(PolicyConfig(tiers)), ControlState(), tiers,
        SystemClock(), lambda coro: coro.close(),
    )  # fmt: skip
    handler = CompletionsHandler(corrections, cast(Any, None))
    await client.set(keys.reservation("acme", "r1"), "100", ex=60)
    try:

        def completion(repeat: bool, used: int) -> Any:
            event = RequestCompleted(
                worker_id="w1", pool="main", request_id="r1", tenant="acme",
                priority=Priority.STANDARD, tier=Tier.PRO, queue_wait_ms=0.0, latency_ms=0.0,
                prompt_tokens=used, completion_tokens=0, at=time.time(), repeat=repeat,
            )  # fmt: skip
            value = encode(event)
            return ConsumerRecord(
                topic="llm.completions", partition=0, offset=0, timestamp=0,
                timestamp_type=0, key=None, value=value, checksum=None,
                serialized_key_size=0, serialized_value_size=len(value), headers=(),
            )  # fmt: skip

        await handler.decide(completion(True, 0))
        assert await client.get(keys.reservation("acme", "r1")) == b"100"
        await handler.decide(completion(False, 40))
        assert await client.get(keys.reservation("acme", "r1")) is None
    finally:
        await delete_prefix(client, prefix)
