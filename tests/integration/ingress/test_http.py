"""HTTP ingress on the real broker and Redis: the test plays the downstream (it reads
the priority topics and answers on the ingress's reply topic)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY, generate_latest

from schemas import (
    AuditEvent,
    InferenceRequest,
    Priority,
    RateLimitInfo,
    ReasonCode,
    ReplyChunk,
    ReplyStatus,
    Tier,
)
from seawall_client.topics import RedisKeys, Topics
from services.common.bus import make_consumer
from services.common.settings import CommonSettings
from services.ingress.service import IngressService
from tests.integration.ingress.conftest import Downstream, Keys, eventually

pytestmark = pytest.mark.integration

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hello there"}]}


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an event stream, JSON-decoded ([DONE] as a string)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def open_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str]
) -> asyncio.Task[httpx.Response]:
    """Start a streamed request. Its response (headers) comes with the first reply: a
    stream's status is only known then."""
    request = client.build_request("POST", path, json=body, headers=headers)
    return asyncio.create_task(client.send(request, stream=True))


async def read_stream(call: asyncio.Task[httpx.Response]) -> tuple[httpx.Response, str]:
    response = await call
    try:
        return response, "".join([part async for part in response.aiter_text()])
    finally:
        await response.aclose()


async def answered(
    client: httpx.AsyncClient,
    downstream: Downstream,
    respond: Callable[[InferenceRequest], Awaitable[None]],
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> tuple[httpx.Response, str, bytes | None, InferenceRequest]:
    """Post, answer the request as it reaches a priority topic, return the response."""
    call = asyncio.create_task(client.post(path, json=body, headers=headers))
    ((topic, key, request),) = await downstream.take(1)
    await respond(request)
    return await call, topic, key, request


async def test_chat_json_enterprise_goes_to_vip_and_gets_its_answer(
    client: httpx.AsyncClient, downstream: Downstream, keys: Keys, topics: Topics
) -> None:
    async def respond(req: InferenceRequest) -> None:
        await downstream.answer(req, "Hi", " there")

    started = time.time()
    response, topic, key, req = await answered(
        client,
        downstream,
        respond,
        "/v1/chat/completions",
        {**CHAT, "user": "session-7", "max_tokens": 64},
        Keys.auth(keys.enterprise) | {"X-Forwarded-For": "203.0.113.9, 10.0.0.2"},
    )
    assert response.status_code == 200, response.text
    assert topic == topics.requests(Priority.VIP)
    assert key == b"session-7"  # keyed by session id
    assert req.tenant == "big-co"
    assert req.tier is Tier.ENTERPRISE
    assert req.priority is Priority.VIP
    assert req.api_key_id is not None
    assert keys.enterprise not in req.model_dump_json()  # the key never travels
    assert req.reply_to.startswith(topics.reply("ingress-"))
    assert req.messages is not None
    assert req.messages[0].content == "hello there"
    assert req.sampling.max_tokens == 64
    assert req.stream is False
    assert req.pool == "main"
    assert req.deadline_at is not None
    assert started + 115 < req.deadline_at <= time.time() + 120  # the default deadline
    # the peer (127.0.0.1) is a trusted proxy: the entry it appended names the client,
    # and 10.0.0.2 is in no trusted network, so what is left of it is never read
    assert req.client.client_ip == "10.0.0.2"
    assert req.client.region == ""

    doc = response.json()
    assert doc["object"] == "chat.completion"
    assert doc["id"] == f"chatcmpl-{req.request_id}"
    assert response.headers["X-Request-Id"] == req.request_id
    assert doc["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
    assert doc["choices"][0]["finish_reason"] == "stop"
    assert doc["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


async def test_completion_stream_basic_goes_to_bulk_and_streams_chunks(
    client: httpx.AsyncClient, downstream: Downstream, keys: Keys, topics: Topics
) -> None:
    body = {
        "model": "small-model",
        "prompt": "Once upon a time",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = Keys.auth(keys.basic) | {"X-Forwarded-For": "198.51.100.20"}
    call = open_stream(client, "/v1/completions", body, headers)
    ((topic, key, req),) = await downstream.take(1)
    assert topic == topics.requests(Priority.BULK)
    assert key == b"basic-co"  # no session: the tenant
    assert req.stream is True
    assert req.pool == "small"
    assert req.client.region == "ap-east"
    await downstream.answer(req, "there", " was", " a", " GPU")
    response, text = await read_stream(call)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    pieces = [e["choices"][0]["text"] for e in events[:-1] if e.get("choices")]
    assert "".join(pieces) == "there was a GPU"
    finals = [e for e in events[:-1] if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["stop"]
    assert events[-2]["usage"]["completion_tokens"] == 4
    assert all(e["id"] == f"cmpl-{req.request_id}" for e in events[:-1])


async def test_chat_stream_pro_degraded_reply(
    client: httpx.AsyncClient, downstream: Downstream, keys: Keys, topics: Topics
) -> None:
    body = {**CHAT, "stream": True}
    call = open_stream(client, "/v1/chat/completions", body, Keys.auth(keys.pro))
    ((topic, _, req),) = await downstream.take(1)
    assert topic == topics.requests(Priority.STANDARD)
    # a static degraded reply: no chunks, the text in the terminal reply
    await downstream.answer(
        req, status=ReplyStatus.DEGRADED, reason=ReasonCode.DEGRADED_STATIC, text="Busy."
    )
    response, text = await read_stream(call)
    assert response.status_code == 200
    assert response.headers["X-Seawall-Degraded"] == "degraded_static"
    events = sse_events(text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [e["choices"][0]["delta"].get("content", "") for e in events[1:-1]]
    assert "".join(contents) == "Busy."
    assert events[-2]["seawall"] == {"degraded": "degraded_static"}
    assert events[-1] == "[DONE]"


async def test_degraded_json_reply_carries_the_header(
    client: httpx.AsyncClient, downstream: Downstream, keys: Keys
) -> None:
    async def respond(req: InferenceRequest) -> None:
        await downstream.answer(
            req, "short", status=ReplyStatus.DEGRADED, reason=ReasonCode.DEGRADED_TRUNCATED
        )

    response, *_ = await answered(
        client, downstream, respond, "/v1/chat/completions", CHAT, Keys.auth(keys.pro)
    )
    assert response.status_code == 200
    assert response.headers["X-Seawall-Degraded"] == "degraded_truncated"
    assert response.json()["choices"][0]["message"]["content"] == "short"


async def test_quota_rejection_is_429_with_rate_limit_headers(
    client: httpx.AsyncClient, downstream: Downstream, keys: Keys
) -> None:
    async def respond(req: InferenceRequest) -> None:
        await downstream.answer(
            req,
            status=ReplyStatus.REJECTED,
            reason=ReasonCode.QUOTA_EXCEEDED,
            message="over quota",
            rate_limit=RateLimitInfo(limit=60, remaining=0, reset_s=12.2, retry_after_s=1.5),
            text="",
            completion_tokens=0,
        )

    response, *_ = await answered(
        client, downstream, respond, "/v1/chat/completions", CHAT, Keys.auth(keys.basic)
    )
    assert response.status_code == 429
    assert response.headers["X-RateLimit-Limit"] == "60"
    assert response.headers["X-RateLimit-Remaining"] == "0"
    assert response.headers["X-RateLimit-Reset"] == "13"
    assert response.headers["Retry-After"] == "2"
    assert response.json() == {
        "error": {
            "message": "over quota",
            "type": "rate_limit_error",
            "param": None,
            "code": "quota_exceeded",
        }
    }


async def test_breaker_rejection_is_503_with_retry_after(
    client: httpx.AsyncClient, downstream: Downstream, keys: Keys
) -> None:
    async def respond(req: InferenceRequest) -> None:
        await downstream.answer(req, status=ReplyStatus.REJECTED, reason=ReasonCode.BREAKER_OPEN)

    response, *_ = await answered(
        client, downstream, respond, "/v1/completions", {"prompt": "x"}, Keys.auth(keys.pro)
    )
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    assert response.json()["error"]["code"] == "breaker_open"


@pytest.mark.parametrize("ingress", [{"reply_margin_s": 0.2}], indirect=True)
async def test_no_reply_by_the_deadline_is_504_and_aborts_downstream(
    client: httpx.AsyncClient,
    downstream: Downstream,
    keys: Keys,
    redis: aioredis.Redis,
    settings: CommonSettings,
) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "timeout": 5},
        headers=Keys.auth(keys.pro) | {"X-Seawall-Timeout": "0.5"},
    )
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"
    ((_, _, req),) = await downstream.take(1)
    assert req.deadline_at is not None
    assert req.deadline_at - req.created_at == pytest.approx(0.5)  # the smaller timeout
    marker = RedisKeys(settings.redis_prefix).abort(req.tenant, req.request_id)
    assert await redis.get(marker) == b"timeout"
    assert 0 < await redis.ttl(marker) <= 61


async def test_a_client_that_leaves_gets_its_request_aborted(
    ingress: IngressService,
    client: httpx.AsyncClient,
    downstream: Downstream,
    keys: Keys,
    redis: aioredis.Redis,
    settings: CommonSettings,
) -> None:
    call = asyncio.create_task(
        client.post("/v1/chat/completions", json=CHAT, headers=Keys.auth(keys.pro))
    )
    ((_, _, req),) = await downstream.take(1)
    call.cancel()  # closes the connection
    marker = RedisKeys(settings.redis_prefix).abort(req.tenant, req.request_id)

    async def marked() -> bool:
        return await redis.get(marker) == b"disconnect"

    await eventually(marked)
    assert ingress.router.waiting == 0
    ttl = await redis.ttl(marker)
    assert 100 < ttl <= 180  # the rest of the deadline, and a margin


async def test_stream_client_that_leaves_gets_its_request_aborted(
    ingress: IngressService,
    client: httpx.AsyncClient,
    downstream: Downstream,
    keys: Keys,
    redis: aioredis.Redis,
    settings: CommonSettings,
) -> None:
    body = {**CHAT, "stream": True}
    call = open_stream(client, "/v1/chat/completions", body, Keys.auth(keys.pro))
    ((_, _, req),) = await downstream.take(1)
    chunk = ReplyChunk(request_id=req.request_id, seq=0, text="a")
    await downstream.send(req.reply_to, chunk, key=req.request_id)
    response = await call
    async for _ in response.aiter_text():
        break  # the first event came: leave
    await response.aclose()
    marker = RedisKeys(settings.redis_prefix).abort(req.tenant, req.request_id)

    async def marked() -> bool:
        return await redis.get(marker) == b"disconnect"

    await eventually(marked)
    assert ingress.router.waiting == 0


async def test_key_phases(
    client: httpx.AsyncClient,
    downstream: Downstream,
    keys: Keys,
    ingress: IngressService,
    backdated: Callable[[str, float], Awaitable[str]],
    settings: CommonSettings,
    topics: Topics,
) -> None:
    grace = await backdated("old-co", 92)  # active 90 days, then 7 of grace
    retired = await backdated("older-co", 100)
    revoked = keys.pro
    revoked_id = revoked.split("_")[0].removeprefix("sk-sw-")
    await ingress.keystore.revoke(revoked_id)

    async def respond(req: InferenceRequest) -> None:
        await downstream.answer(req, "ok")

    response, *_ = await answered(
        client, downstream, respond, "/v1/chat/completions", CHAT, Keys.auth(grace)
    )
    assert response.status_code == 200
    assert response.headers["Deprecation"].startswith("@")
    assert response.headers["Sunset"].endswith("GMT")

    cases = {
        "missing": ({}, "missing_api_key"),
        "not a key": (Keys.auth("hello"), "invalid_api_key"),
        "unknown": (Keys.auth("sk-sw-0123456789ab_" + "A" * 43), "invalid_api_key"),
        "wrong secret": (Keys.auth(keys.basic[:-2] + "zz"), "invalid_api_key"),
        "retired": (Keys.auth(retired), "key_retired"),
        "revoked": (Keys.auth(revoked), "key_revoked"),
    }
    for name, (headers, code) in cases.items():
        r = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 401, name
        assert r.json()["error"]["code"] == code, name
        assert r.json()["error"]["type"] == "authentication_error"
    # nothing but the grace key's request reached the priority topics
    await downstream.poll(300)
    assert len(downstream.seen) == 1

    models = await client.get("/v1/models", headers=Keys.auth(grace))
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == ["default", "small-model"]
    assert (await client.get("/v1/models")).status_code == 401

    audit = await read_audit(settings, topics, 3)
    denied = [e for e in audit if e.action == "key_denied"]
    reasons = sorted(e.detail["reason"] for e in denied)
    assert reasons == ["bad_secret", "key_retired", "key_revoked"]


async def read_audit(
    settings: CommonSettings, topics: Topics, want_denied: int
) -> list[AuditEvent]:
    consumer = make_consumer(settings, topics.audit, group_id=None)
    await consumer.start()
    events: list[AuditEvent] = []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                events += [AuditEvent.model_validate_json(r.value) for r in records]
            if sum(e.action in ("key_denied", "request_blocked") for e in events) >= want_denied:
                break
    finally:
        await consumer.stop()
    return events


async def test_sensitive_data_blocked_or_redacted_per_tenant(
    client: httpx.AsyncClient,
    downstream: Downstream,
    keys: Keys,
    settings: CommonSettings,
    topics: Topics,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "call me at 13812345678, 密码: hunter22"
    body = {"messages": [{"role": "user", "content": secret}]}
    blocked = await client.post("/v1/chat/completions", json=body, headers=Keys.auth(keys.blocking))
    assert blocked.status_code == 400
    error = blocked.json()["error"]
    assert error["code"] == "sensitive_data"
    assert "13812345678" not in blocked.text
    assert "hunter22" not in blocked.text

    async def respond(req: InferenceRequest) -> None:
        await downstream.answer(req, "noted")

    response, _, _, req = await answered(
        client, downstream, respond, "/v1/chat/completions", body, Keys.auth(keys.enterprise)
    )
    assert response.status_code == 200
    assert req.messages is not None
    assert req.messages[0].content == "call me at [REDACTED:mobile], 密码: [REDACTED:credential]"

    (event,) = [e for e in await read_audit(settings, topics, 1) if e.action == "request_blocked"]
    assert event.tenant == "careful-co"
    assert event.detail["mobile"] == "1"
    assert event.detail["credential"] == "1"
    assert "13812345678" not in event.model_dump_json()
    assert all("13812345678" not in r.getMessage() for r in caplog.records)
    assert all("hunter22" not in str(r.__dict__) for r in caplog.records)


async def test_a_screen_bomb_is_refused_whatever_the_policy_and_others_are_served(
    client: httpx.AsyncClient, downstream: Downstream, keys: Keys
) -> None:
    """A prompt of thousands of sensitive findings (``"pwd:x "`` over 16 KiB) is refused
    before any redaction, even for a tenant whose policy redacts; the same tenant's
    request with a couple of findings is still redacted and served."""
    bomb = ("pwd:x " * 3000)[:15_000]
    body = {"messages": [{"role": "user", "content": bomb}]}
    for key in (keys.enterprise, keys.blocking):  # redact and block policies alike
        refused = await client.post("/v1/chat/completions", json=body, headers=Keys.auth(key))
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "too_much_sensitive_data"

    async def respond(req: InferenceRequest) -> None:
        await downstream.answer(req, "noted")

    fine = {"messages": [{"role": "user", "content": "pwd: a1 and pwd: b2"}]}
    response, _, _, req = await answered(
        client, downstream, respond, "/v1/chat/completions", fine, Keys.auth(keys.enterprise)
    )
    assert response.status_code == 200
    assert req.messages is not None
    assert req.messages[0].content == "pwd: [REDACTED:credential] and pwd: [REDACTED:credential]"


async def test_health_models_and_metrics(client: httpx.AsyncClient, keys: Keys) -> None:
    assert (await client.get("/health")).json() == {"status": "ok"}
    r = await client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 10**6}, headers=Keys.auth(keys.pro)
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    r = await client.post(
        "/v1/completions", json={"prompt": "x", "model": "nope"}, headers=Keys.auth(keys.pro)
    )
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert (await client.get("/metrics")).status_code == 404  # never on the public API
    metrics = generate_latest(REGISTRY).decode()  # what the metrics port serves
    assert "seawall_ingress_prompt_tokens_bucket" in metrics
    assert "seawall_ingress_long_prompt_share" in metrics
    assert 'seawall_ingress_refusals_total{code="schema_violation",source="http"}' in metrics
    unknown = await client.get("/v2/whatever")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "invalid_request_error"


async def test_stopping_lets_a_waiting_request_finish(
    ingress: IngressService, client: httpx.AsyncClient, downstream: Downstream, keys: Keys
) -> None:
    call = asyncio.create_task(
        client.post("/v1/chat/completions", json=CHAT, headers=Keys.auth(keys.pro))
    )
    ((_, _, req),) = await downstream.take(1)
    stopping = asyncio.create_task(ingress.stop())
    await asyncio.sleep(0.3)  # the listener is closing; the request is still waiting
    assert not stopping.done()
    await downstream.answer(req, "just in time")
    response = await call
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "just in time"
    await stopping
    assert not ingress.failed.is_set()


async def test_damaged_records_refuse_the_key_and_crash_nothing(
    ingress: IngressService,
    client: httpx.AsyncClient,
    keys: Keys,
    redis: aioredis.Redis,
    settings: CommonSettings,
) -> None:
    layout = RedisKeys(settings.redis_prefix)
    basic_id = keys.basic.split("_")[0].removeprefix("sk-sw-")
    await redis.hset(layout.api_key(basic_id), "created_at", "yesterday")
    await redis.hset(f"{settings.redis_prefix}tenant:{{pro-co}}:policy", "tier", "platinum")

    damaged_key = await client.post(
        "/v1/chat/completions", json=CHAT, headers=Keys.auth(keys.basic)
    )
    assert damaged_key.status_code == 401
    assert damaged_key.json()["error"]["code"] == "invalid_api_key"
    damaged_policy = await client.post(
        "/v1/chat/completions", json=CHAT, headers=Keys.auth(keys.pro)
    )
    assert damaged_policy.status_code == 403
    assert damaged_policy.json()["error"]["code"] == "tenant_unknown"
    assert (await client.get("/health")).status_code == 200
    assert not ingress.failed.is_set()


@pytest.mark.parametrize(
    # refilled once an hour: the test does not depend on how fast this machine is
    "ingress",
    [{"failed_auth_per_source_per_s": 1 / 3600}],
    indirect=True,
)
async def test_failures_are_refused_past_their_budget_but_never_lock_out_a_right_key(
    client: httpx.AsyncClient, keys: Keys
) -> None:
    """Failed authentications cost the attacker: past its budget (20) a (source, key id)
    gets 429 with Retry-After. Through a trusted proxy (the test client, 127.0.0.1) the
    source is the forwarded address. The attack that used to work — bad keys sent under
    a victim's forwarded address — no longer touches the victim: its right key from that
    address is still authenticated, and so is any other address."""
    victim = {"X-Forwarded-For": "198.51.100.66"}  # appended by the trusted proxy
    bad = Keys.auth("sk-sw-0123456789ab_" + "x" * 43) | victim
    codes = [
        (await client.post("/v1/chat/completions", json=CHAT, headers=bad)).status_code
        for _ in range(21)
    ]
    assert codes[:20] == [401] * 20
    assert codes[20] == 429
    blocked = await client.post("/v1/chat/completions", json=CHAT, headers=bad)
    assert blocked.json()["error"]["code"] == "too_many_failures"
    assert int(blocked.headers["Retry-After"]) >= 1
    # The victim's right key from the same address is authenticated (and refused only
    # for the model it names: proof it got past authentication).
    served = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "model": "no-such-model"},
        headers=Keys.auth(keys.pro) | victim,
    )
    assert served.status_code == 404
    assert served.json()["error"]["code"] == "model_not_found"
    elsewhere = Keys.auth("sk-sw-0123456789ab_" + "y" * 43) | {"X-Forwarded-For": "203.0.113.7"}
    assert (
        await client.post("/v1/chat/completions", json=CHAT, headers=elsewhere)
    ).status_code == 401


@pytest.mark.parametrize(
    # The trusted proxy is 127.0.0.2; the test's own client, connecting from 127.0.0.1,
    # is a stranger connecting directly. Refilled once an hour, as above.
    "ingress",
    [{"failed_auth_per_source_per_s": 1 / 3600, "trusted_proxies": ("127.0.0.2/32",)}],
    indirect=True,
)
async def test_a_directly_connected_client_cannot_spend_a_forwarded_victims_budget(
    ingress: IngressService, client: httpx.AsyncClient, keys: Keys
) -> None:
    """An attacker connecting directly sends bad secrets for the victim's key id, naming
    the victim's address in X-Forwarded-For (and others, and garbage). The header is
    ignored: the failures are counted against the attacker's own address, which is
    refused 429 after 20 whatever it forwards; the victim, reaching ingress through the
    trusted proxy, still has its whole budget of failures and its right key works."""
    kid = keys.pro.split("_")[0].removeprefix("sk-sw-")
    bad = Keys.auth(f"sk-sw-{kid}_" + "x" * 43)
    forged = ["198.51.100.66", "198.51.100.66, 127.0.0.2", "203.0.113.7", "garbage"]
    codes = [
        (
            await client.post(
                "/v1/chat/completions",
                json=CHAT,
                headers=bad | {"X-Forwarded-For": forged[i % len(forged)]},
            )
        ).status_code
        for i in range(21)
    ]
    assert codes == [401] * 20 + [429]

    proxy = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{ingress.port}", transport=proxy, timeout=30
    ) as through_proxy:
        victim = {"X-Forwarded-For": "198.51.100.66"}
        served = await through_proxy.post(
            "/v1/chat/completions",
            json={**CHAT, "model": "no-such-model"},
            headers=Keys.auth(keys.pro) | victim,
        )
        assert served.status_code == 404
        assert served.json()["error"]["code"] == "model_not_found"
        # The victim's own (address, key id) budget is whole: 20 failures, then 429 —
        # counted by the forwarded address, as the trusted proxy vouches for it.
        victim_codes = [
            (
                await through_proxy.post("/v1/chat/completions", json=CHAT, headers=bad | victim)
            ).status_code
            for _ in range(21)
        ]
        assert victim_codes == [401] * 20 + [429]
