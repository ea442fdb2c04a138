"""The client SDK against the real Kafka ingress, broker and Redis; a downstream plays
admission and the workers (answers, rejections, silence, duplicates)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from schemas import (
    InferenceReply,
    InferenceRequest,
    Priority,
    RateLimitInfo,
    ReasonCode,
    ReplyChunk,
    ReplyStatus,
)
from seawall_client import RetryPolicy, SeawallClient, SyncSeawallClient
from seawall_client.topics import RedisKeys
from services.common.settings import CommonSettings
from services.ingress.service import IngressService
from tests.integration.ingress.conftest import Downstream, Keys, eventually

pytestmark = [
    pytest.mark.integration,
    pytest.mark.parametrize("ingress", [{"kafka_ingress": True}], indirect=True),
]

FAST_RETRIES = RetryPolicy(max_attempts=3, base_s=0.05, cap_s=0.2)


@pytest.fixture
async def client(
    ingress: IngressService, keys: Keys, settings: CommonSettings
) -> AsyncIterator[SeawallClient]:
    async with SeawallClient(
        api_key=keys.pro, kafka=settings.kafka, retry=FAST_RETRIES, timeout_s=30
    ) as c:
        yield c


async def next_request(downstream: Downstream, after: int) -> InferenceRequest:
    """The request after the first ``after`` seen (waits for the Kafka ingress group)."""
    _, _, request = (await downstream.take(after + 1, timeout_s=30))[after]
    return request


async def test_complete_and_stream_get_their_replies_once(
    client: SeawallClient, downstream: Downstream
) -> None:
    call = asyncio.create_task(client.complete("hello", max_tokens=8))
    request = await next_request(downstream, 0)
    assert request.reply_to == client.reply_topic
    assert (request.tenant, request.priority) == ("pro-co", Priority.STANDARD)  # from the key
    assert request.deadline_at is not None
    assert request.stream is False
    await downstream.answer(request, "hi", " there")
    await downstream.answer(request, "hi", " there")  # redelivered, chunks and all
    reply = await call
    assert (reply.status, reply.text) == (ReplyStatus.OK, "hi there")

    items: list[ReplyChunk | InferenceReply] = []

    async def read() -> None:
        async for item in client.stream("story", max_tokens=8, session_id="chat-9"):
            items.append(item)

    reading = asyncio.create_task(read())
    request = await next_request(downstream, 1)
    assert request.stream is True
    await downstream.answer(request, "once", " upon")
    await reading
    assert [type(i).__name__ for i in items] == ["ReplyChunk", "ReplyChunk", "InferenceReply"]

    async def duplicates_dropped() -> bool:
        return client.stats.duplicates == 3  # the repeated 2 chunks and terminal reply

    await eventually(duplicates_dropped)
    stats = client.stats
    assert (stats.submitted, stats.attempts, stats.terminal_replies) == (2, 2, 2)
    assert (stats.retries, stats.timeouts, stats.aborted) == (0, 0, 0)


async def test_retryable_rejections_are_retried_after_retry_after(
    client: SeawallClient, downstream: Downstream
) -> None:
    call = asyncio.create_task(client.complete("hello", request_id="r-1"))
    first = await next_request(downstream, 0)
    assert first.request_id == "r-1"
    limits = RateLimitInfo(limit=5, remaining=0, reset_s=1.0, retry_after_s=0.5)
    await downstream.answer(
        first, status=ReplyStatus.REJECTED, reason=ReasonCode.QUOTA_EXCEEDED, rate_limit=limits
    )
    rejected_at = time.monotonic()
    second = await next_request(downstream, 1)
    assert time.monotonic() - rejected_at >= 0.5  # not before the server's Retry-After
    assert second.request_id == "r-1.2"  # a new id per attempt
    await downstream.answer(second, "ok")
    reply = await call
    assert (reply.status, reply.request_id, reply.text) == (ReplyStatus.OK, "r-1.2", "ok")
    assert (client.stats.attempts, client.stats.retries) == (2, 1)


async def test_a_late_copy_of_a_rejection_is_not_taken_for_the_retry(
    client: SeawallClient, downstream: Downstream
) -> None:
    call = asyncio.create_task(client.complete("hello", request_id="r-2"))
    first = await next_request(downstream, 0)
    await downstream.answer(first, status=ReplyStatus.REJECTED, reason=ReasonCode.OVERLOADED)
    second = await next_request(downstream, 1)
    await downstream.answer(first, status=ReplyStatus.REJECTED, reason=ReasonCode.OVERLOADED)
    await asyncio.sleep(0.5)
    assert not call.done()
    await downstream.answer(second, "fine")
    assert (await call).text == "fine"


async def test_retries_end_with_the_last_rejection_and_refusals_are_not_retried(
    client: SeawallClient, downstream: Downstream
) -> None:
    call = asyncio.create_task(client.complete("hello", request_id="busy"))
    for n in range(3):
        request = await next_request(downstream, n)
        await downstream.answer(
            request, status=ReplyStatus.REJECTED, reason=ReasonCode.BREAKER_OPEN
        )
    reply = await call
    assert (reply.status, reply.reason, reply.request_id) == (
        ReplyStatus.REJECTED,
        ReasonCode.BREAKER_OPEN,
        "busy.3",
    )
    call = asyncio.create_task(client.complete("hello", request_id="refused"))
    request = await next_request(downstream, 3)
    await downstream.answer(request, status=ReplyStatus.REJECTED, reason=ReasonCode.INVALID_REQUEST)
    assert (await call).reason is ReasonCode.INVALID_REQUEST
    await downstream.poll(500)
    assert len(downstream.seen) == 4
    assert (client.stats.attempts, client.stats.retries) == (4, 2)


async def test_a_stream_that_has_shown_text_is_not_retried(
    client: SeawallClient, downstream: Downstream
) -> None:
    items: list[ReplyChunk | InferenceReply] = []

    async def read() -> None:
        items.extend([item async for item in client.stream("story")])

    reading = asyncio.create_task(read())
    request = await next_request(downstream, 0)
    await downstream.answer(
        request, "half a sto", status=ReplyStatus.ERROR, reason=ReasonCode.WORKER_SHUTDOWN
    )
    await reading
    terminal = items[-1]
    assert isinstance(terminal, InferenceReply)
    assert terminal.reason is ReasonCode.WORKER_SHUTDOWN
    assert client.stats.retries == 0


async def test_a_timed_out_request_is_aborted_downstream(
    client: SeawallClient, downstream: Downstream, redis: aioredis.Redis, settings: CommonSettings
) -> None:
    marker = RedisKeys(settings.redis_prefix).abort("pro-co", "silent")
    with pytest.raises(TimeoutError):
        await client.complete("hello", request_id="silent", timeout_s=3)
    await eventually(lambda: _exists(redis, marker))
    ttl = await redis.ttl(marker)
    assert 0 < ttl <= 3 + 60 + 1  # outlives the deadline by ingress's margin, then goes
    assert (client.stats.timeouts, client.stats.aborted, client.stats.terminal_replies) == (
        1,
        1,
        0,
    )


async def test_a_cancelled_call_and_an_abandoned_stream_are_aborted(
    client: SeawallClient, downstream: Downstream, redis: aioredis.Redis, settings: CommonSettings
) -> None:
    keys = RedisKeys(settings.redis_prefix)
    call = asyncio.create_task(client.complete("hello", request_id="gone"))
    await next_request(downstream, 0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await eventually(lambda: _exists(redis, keys.abort("pro-co", "gone")))

    stream = client.stream("story", request_id="left")
    reading = asyncio.create_task(anext(stream))
    request = await next_request(downstream, 1)
    await downstream.send(
        request.reply_to, ReplyChunk(request_id="left", seq=0, text="once"), key="left"
    )
    assert isinstance(await reading, ReplyChunk)
    await stream.aclose()  # the caller stops reading half-way
    await eventually(lambda: _exists(redis, keys.abort("pro-co", "left")))
    assert client.stats.aborted == 2


async def _exists(redis: aioredis.Redis, key: str) -> bool:
    return bool(await redis.exists(key))


async def test_the_sync_client_for_scripts(
    ingress: IngressService, keys: Keys, settings: CommonSettings, downstream: Downstream
) -> None:
    def script() -> InferenceReply:
        with SyncSeawallClient(api_key=keys.basic, kafka=settings.kafka) as sync:
            return sync.complete(messages=[{"role": "user", "content": "hi"}], max_tokens=4)

    call = asyncio.create_task(asyncio.to_thread(script))
    request = await next_request(downstream, 0)
    assert request.messages is not None
    assert request.priority is Priority.BULK
    await downstream.answer(request, "hey")
    reply = await call
    assert reply.text == "hey"


async def test_the_fleets_expired_answer_after_the_deadline_is_returned(
    client: SeawallClient, downstream: Downstream
) -> None:
    call = asyncio.create_task(client.complete("hello", request_id="late", timeout_s=4))
    request = await next_request(downstream, 0)
    assert request.deadline_at is not None
    await asyncio.sleep(max(0.0, request.deadline_at - time.time()) + 0.5)
    await downstream.answer(
        request, status=ReplyStatus.EXPIRED, reason=ReasonCode.DEADLINE_EXCEEDED
    )
    reply = await call
    assert reply.status is ReplyStatus.EXPIRED
    assert (client.stats.timeouts, client.stats.aborted) == (0, 0)
