"""The pipeline's pure parts: what a request becomes on its way to the priority topic."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import REGISTRY

from schemas import (
    ChatMessage,
    ClientMeta,
    InferenceRequest,
    Priority,
    QuotaHint,
    RateLimitInfo,
    ReasonCode,
    Tier,
)
from services.common.tokenizer import count_tokens
from services.ingress.keystore import TenantPolicy
from services.ingress.openai import error_for_refusal
from services.ingress.pipeline import Principal
from services.ingress.policy.keys import DAY_S, KeyRecord, check
from services.ingress.refusals import Refusal
from tests.unit.ingress.conftest import Parts

pytestmark = pytest.mark.unit


def principal(parts: Parts, tier: Tier = Tier.ENTERPRISE, age_days: float = 0) -> Principal:
    now = parts.clock.time()
    record = KeyRecord("0123456789ab", "big-co", "hash", now - age_days * DAY_S)
    decision = check(record, "inference", now)
    grace = decision.disabled_at - 7 * DAY_S if decision.reason == "key_in_grace" else None
    return Principal("big-co", record.key_id, TenantPolicy(tier, "redact"), decision, grace)


def request(parts: Parts, **changes: object) -> InferenceRequest:
    fields: dict[str, object] = {
        "request_id": "r1",
        "tenant": "someone-else",
        "tier": Tier.BASIC,
        "priority": Priority.BULK,
        "prompt": "hello",
        "reply_to": "llm.reply.x",
        "created_at": parts.clock.time(),
    }
    fields.update(changes)
    return InferenceRequest(**fields)


async def test_the_key_decides_tenant_tier_and_priority(parts: Parts) -> None:
    now = parts.clock.time()
    before = REGISTRY.get_sample_value("seawall_ingress_prompt_tokens_count") or 0.0
    got = await parts.pipeline.prepare(
        request(parts, model="tiny", client=ClientMeta(client_ip="203.0.113.7")),
        principal(parts),
    )
    assert isinstance(got, InferenceRequest)
    assert (got.tenant, got.tier, got.priority) == ("big-co", Tier.ENTERPRISE, Priority.VIP)
    assert got.api_key_id == "0123456789ab"
    assert got.pool == "small"
    assert got.deadline_at == now + 120
    assert got.client.region == "eu-west"
    assert REGISTRY.get_sample_value("seawall_ingress_prompt_tokens_count") == before + 1


async def test_ingress_counts_the_prompt_whatever_the_producer_wrote(parts: Parts) -> None:
    """Admission reserves what ``prompt_tokens`` says: a producer's figure never
    reaches it, and a redacted prompt is counted as the engine will read it."""
    forged = await parts.pipeline.prepare(
        request(parts, prompt="hello there world", prompt_tokens=0), principal(parts)
    )
    assert isinstance(forged, InferenceRequest)
    assert forged.prompt_tokens == count_tokens("hello there world") == 3
    messages = (ChatMessage(role="user", content="password: hunter22 please"),)
    redacted = await parts.pipeline.prepare(
        request(parts, prompt=None, messages=messages, prompt_tokens=10**6), principal(parts)
    )
    assert isinstance(redacted, InferenceRequest)
    assert redacted.messages is not None
    assert redacted.prompt_tokens == count_tokens(redacted.messages[0].content)
    assert redacted.prompt_tokens != count_tokens(messages[0].content)


async def test_deadlines_only_get_shorter(parts: Parts) -> None:
    now = parts.clock.time()
    soon = await parts.pipeline.prepare(request(parts, deadline_at=now + 5), principal(parts))
    late = await parts.pipeline.prepare(request(parts, deadline_at=now + 500), principal(parts))
    assert isinstance(soon, InferenceRequest)
    assert isinstance(late, InferenceRequest)
    assert soon.deadline_at == now + 5
    assert late.deadline_at == now + 120


async def test_sensitive_values_are_redacted_under_redact(parts: Parts) -> None:
    messages = (
        ChatMessage(role="system", content="no secrets"),
        ChatMessage(role="user", content="password: hunter22 please"),
    )
    got = await parts.pipeline.prepare(
        request(parts, prompt=None, messages=messages), principal(parts, Tier.PRO)
    )
    assert isinstance(got, InferenceRequest)
    assert got.messages is not None
    assert [m.content for m in got.messages] == [
        "no secrets",
        "password: [REDACTED:credential] please",
    ]
    assert got.priority is Priority.STANDARD


@pytest.mark.parametrize(
    ("changes", "code", "param"),
    [
        ({"model": "gpt-9"}, "model_not_found", "model"),
        ({"sampling": {"max_tokens": 1001}}, "max_tokens_too_large", "max_tokens"),
    ],
)
async def test_refusals(parts: Parts, changes: dict[str, object], code: str, param: str) -> None:
    got = await parts.pipeline.prepare(request(parts, **changes), principal(parts))
    assert isinstance(got, Refusal)
    assert (got.reason, got.code, got.param) == (ReasonCode.INVALID_REQUEST, code, param)


def test_grace_keys_carry_deprecation_headers(parts: Parts) -> None:
    assert principal(parts).deprecation_headers == {}
    headers = principal(parts, age_days=91).deprecation_headers
    assert set(headers) == {"Deprecation", "Sunset"}
    assert headers["Deprecation"] == f"@{int(parts.clock.time() - DAY_S)}"
    assert headers["Sunset"].endswith(" GMT")


def test_cheap_filters(parts: Parts) -> None:
    pipeline = parts.pipeline
    assert pipeline.check_size(b"x" * 10, 10) is None
    too_large = pipeline.check_size(b"x" * 11, 10)
    assert too_large is not None
    assert too_large.code == "body_too_large"
    blocked = pipeline.check_user_agent("Mozilla/5.0 sqlmap/1.7")
    assert blocked is not None
    assert (blocked.reason, blocked.code) == (ReasonCode.FORBIDDEN, "user_agent_blocked")
    assert pipeline.check_user_agent("curl/8") is None
    assert pipeline.region("203.0.113.200") == "eu-west"
    assert pipeline.region("not an ip") == ""


async def test_a_quota_hint_refuses_its_tenant_until_it_passes(parts: Parts) -> None:
    """Admission found big-co's requests bucket empty for 1.5 s: ingress answers its
    requests itself until then (429, the rejection's figures), then lets them through
    to admission again; other tenants are not touched."""
    now = parts.clock.time()
    info = RateLimitInfo(limit=20, remaining=0, reset_s=20.0, retry_after_s=2.0)
    parts.pipeline.hints.observe(
        QuotaHint(tenant="big-co", until=now + 1.5, issued_at=now - 0.5, rate_limit=info), now
    )
    refused = await parts.pipeline.prepare(request(parts), principal(parts))
    assert isinstance(refused, Refusal)
    assert (refused.reason, refused.code, refused.retry_after_s) == (
        ReasonCode.QUOTA_EXCEEDED,
        "quota_exceeded",
        2,
    )
    assert refused.rate_limit == RateLimitInfo(
        limit=20, remaining=0, reset_s=19.5, retry_after_s=2.0
    )
    error = error_for_refusal(refused)
    assert error.status == 429
    assert error.headers == {
        "X-RateLimit-Limit": "20",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": "20",
        "Retry-After": "2",
    }
    other = dataclasses.replace(principal(parts), tenant="small-co")
    assert isinstance(await parts.pipeline.prepare(request(parts), other), InferenceRequest)
    parts.clock.advance(1.5)
    assert isinstance(
        await parts.pipeline.prepare(request(parts), principal(parts)), InferenceRequest
    )


async def test_the_long_prompt_share_gauge_decays_when_traffic_stops(parts: Parts) -> None:
    long_prompt = "word " * 6_000
    await parts.pipeline.prepare(request(parts, prompt=long_prompt), principal(parts))
    assert REGISTRY.get_sample_value("seawall_ingress_long_prompt_share") == 1.0
    parts.clock.advance(400.0)  # past the 300 s window, no prompt since
    assert REGISTRY.get_sample_value("seawall_ingress_long_prompt_share") == 0.0


async def test_arrivals_are_counted_per_region_refused_or_not(parts: Parts) -> None:
    eu = ClientMeta(client_ip="203.0.113.7")
    await parts.pipeline.prepare(request(parts, client=eu), principal(parts))
    await parts.pipeline.prepare(request(parts, client=eu, model="gpt-9"), principal(parts))
    await parts.pipeline.prepare(request(parts), principal(parts))  # no known region: not counted
    parts.clock.advance(2.0)
    report = parts.pipeline.arrivals.take("i1")
    assert report is not None
    assert (report.instance, report.counts, report.window_s) == ("i1", {"eu-west": 2}, 2.0)
    assert parts.pipeline.arrivals.take("i1") is None  # a new interval, nothing in it
