"""The OpenAI surface, pure: parsing bodies, building requests, mapping replies and
refusals to statuses, shaping answers."""

from __future__ import annotations

import json

import pytest

from schemas import (
    ClientMeta,
    InferenceReply,
    InferenceRequest,
    RateLimitInfo,
    ReasonCode,
    ReplyStatus,
)
from services.common.openai_shapes import SSE_DONE, sse
from services.ingress import openai as oai
from services.ingress.refusals import Refusal, invalid

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0


def parse_chat(raw: bytes) -> oai.ChatBody | Refusal:
    return oai.parse_body(raw, oai.ChatBody)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"\xff{}", "invalid_utf8"),
        (b"{nope", "invalid_json"),
        (b"", "invalid_json"),
        (b"[" * 100_000, "invalid_json"),  # deeper than the parser's recursion limit
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),  # past int digit limit
        (b"[1, 2]", "schema_violation"),
        (b'{"messages": []}', "schema_violation"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', "schema_violation"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "schema_violation"),
    ],
)
def test_bad_bodies_are_refused_with_stable_codes(raw: bytes, code: str) -> None:
    refusal = parse_chat(raw)
    assert isinstance(refusal, Refusal)
    assert refusal.code == code
    assert refusal.reason is ReasonCode.INVALID_REQUEST


def test_refusals_never_echo_the_input() -> None:
    secret = "hunter2-secret-value"
    refusal = parse_chat(json.dumps({"messages": secret}).encode())
    assert isinstance(refusal, Refusal)
    assert refusal.param == "messages"
    assert secret not in refusal.message


def draft(body: oai.Body, **changes: object) -> InferenceRequest | Refusal:
    args: dict[str, object] = {
        "request_id": "r1",
        "tenant": "acme",
        "model": "default",
        "reply_to": "llm.reply.ingress-1",
        "created_at": T0,
        "timeout_s": None,
        "session_id": None,
        "client": ClientMeta(),
    }
    args.update(changes)
    return oai.to_request(body, **args)  # type: ignore[arg-type]


PART = {"type": "text", "text": "you"}


def test_chat_body_becomes_a_request() -> None:
    body = parse_chat(
        json.dumps(
            {
                "model": "default",
                "messages": [
                    {"role": "developer", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "hi "},
                            {"type": "text", "text": "you"},
                        ],
                    },
                ],
                "max_tokens": 10,
                "max_completion_tokens": 20,
                "temperature": 0.5,
                "stop": "END",
                "seed": 7,
                "stream": True,
                "logprobs": True,  # unknown to us: ignored, as vLLM does
                "timeout": 30,
            }
        ).encode()
    )
    assert isinstance(body, oai.ChatBody)
    req = draft(body, timeout_s=60, session_id="s-1")
    assert isinstance(req, InferenceRequest)
    assert req.messages is not None
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "be brief"),
        ("user", "hi you"),
    ]
    assert req.sampling.max_tokens == 20  # max_completion_tokens wins
    assert req.sampling.temperature == 0.5
    assert req.sampling.stop == ("END",)
    assert req.sampling.seed == 7
    assert req.stream is True
    assert req.deadline_at == T0 + 30  # the smaller of body and header timeouts
    assert req.session_id == "s-1"
    assert req.prompt is None


def test_completion_body_becomes_a_request() -> None:
    body = oai.parse_body(b'{"prompt": ["once"], "max_tokens": 5}', oai.CompletionBody)
    assert isinstance(body, oai.CompletionBody)
    req = draft(body)
    assert isinstance(req, InferenceRequest)
    assert (req.prompt, req.messages, req.deadline_at) == ("once", None, None)
    assert req.sampling.max_tokens == 5


@pytest.mark.parametrize("max_tokens", [0, -1, 32_769, 10**30, 1.5, "many", [3]])
def test_absurd_max_tokens_is_refused_by_name(max_tokens: object) -> None:
    body = oai.parse_body(
        json.dumps({"prompt": "x", "max_tokens": max_tokens}).encode(), oai.CompletionBody
    )
    assert isinstance(body, oai.CompletionBody)
    refusal = draft(body)
    assert isinstance(refusal, Refusal)
    assert (refusal.code, refusal.param) == ("schema_violation", "max_tokens")


def test_an_invalid_session_id_is_refused() -> None:
    body = oai.parse_body(b'{"prompt": "x", "user": "has spaces"}', oai.CompletionBody)
    assert isinstance(body, oai.CompletionBody)
    refusal = draft(body, session_id=body.user)
    assert isinstance(refusal, Refusal)
    assert refusal.param == "session_id"


@pytest.mark.parametrize(
    ("refusal", "status", "kind"),
    [
        (invalid("invalid_json", "m"), 400, "invalid_request_error"),
        (invalid("body_too_large", "m"), 413, "invalid_request_error"),
        (invalid("model_not_found", "m"), 404, "invalid_request_error"),
        (Refusal(ReasonCode.SENSITIVE_DATA, "sensitive_data", "m"), 400, "invalid_request_error"),
        (Refusal(ReasonCode.UNAUTHENTICATED, "key_revoked", "m"), 401, "authentication_error"),
        (Refusal(ReasonCode.FORBIDDEN, "user_agent_blocked", "m"), 403, "permission_error"),
    ],
)
def test_refusal_statuses(refusal: Refusal, status: int, kind: str) -> None:
    error = oai.error_for_refusal(refusal)
    assert error.status == status
    assert error.body() == {
        "error": {"message": "m", "type": kind, "param": None, "code": refusal.code}
    }


def reply(
    status: ReplyStatus, reason: ReasonCode = ReasonCode.NONE, **kw: object
) -> InferenceReply:
    return InferenceReply(request_id="r1", status=status, reason=reason, completed_at=T0, **kw)


@pytest.mark.parametrize(
    ("status", "reason", "http"),
    [
        (ReplyStatus.OK, ReasonCode.NONE, None),
        (ReplyStatus.DEGRADED, ReasonCode.DEGRADED_SMALL_MODEL, None),
        (ReplyStatus.REJECTED, ReasonCode.QUOTA_EXCEEDED, 429),
        (ReplyStatus.REJECTED, ReasonCode.REGION_THROTTLED, 429),
        (ReplyStatus.REJECTED, ReasonCode.BREAKER_OPEN, 503),
        (ReplyStatus.REJECTED, ReasonCode.OVERLOADED, 503),
        (ReplyStatus.REJECTED, ReasonCode.QUOTA_UNAVAILABLE, 503),
        (ReplyStatus.REJECTED, ReasonCode.INVALID_REQUEST, 400),
        (ReplyStatus.REJECTED, ReasonCode.UNAUTHENTICATED, 401),
        (ReplyStatus.REJECTED, ReasonCode.FORBIDDEN, 403),
        (ReplyStatus.REJECTED, ReasonCode.DEADLINE_EXCEEDED, 504),
        (ReplyStatus.REJECTED, ReasonCode.CANCELLED, 499),
        (ReplyStatus.EXPIRED, ReasonCode.DEADLINE_EXCEEDED, 504),
        (ReplyStatus.ERROR, ReasonCode.ENGINE_ERROR, 502),
        (ReplyStatus.ERROR, ReasonCode.REPLY_UNDELIVERABLE, 502),
        (ReplyStatus.ERROR, ReasonCode.WORKER_SHUTDOWN, 503),
        (ReplyStatus.ERROR, ReasonCode.INVALID_REQUEST, 400),
        (ReplyStatus.ERROR, ReasonCode.STREAM_INTERRUPTED, 502),
    ],
)
def test_reply_statuses(status: ReplyStatus, reason: ReasonCode, http: int | None) -> None:
    error = oai.error_for_reply(reply(status, reason), default_retry_after_s=3)
    if http is None:
        assert error is None
        return
    assert error is not None
    assert error.status == http
    assert error.code == reason.value
    assert ("Retry-After" in error.headers) == (http in (429, 503))


def test_a_specific_code_is_openais_code() -> None:
    too_long = reply(
        ReplyStatus.REJECTED,
        ReasonCode.INVALID_REQUEST,
        code="context_length_exceeded",
        message="This model's maximum context length is 4096 tokens.",
    )
    error = oai.error_for_reply(too_long, 3)
    assert error is not None
    assert (error.status, error.code) == (400, "context_length_exceeded")
    assert error.body()["error"]["code"] == "context_length_exceeded"


def test_rate_limit_headers_come_from_the_reply() -> None:
    info = RateLimitInfo(limit=100, remaining=3, reset_s=0.2, retry_after_s=0)
    error = oai.error_for_reply(
        reply(ReplyStatus.REJECTED, ReasonCode.QUOTA_EXCEEDED, rate_limit=info), 3
    )
    assert error is not None
    assert error.headers == {
        "X-RateLimit-Limit": "100",
        "X-RateLimit-Remaining": "3",
        "X-RateLimit-Reset": "1",
        "Retry-After": "1",  # whole seconds, at least one
    }
    # without figures: the configured Retry-After
    error = oai.error_for_reply(reply(ReplyStatus.REJECTED, ReasonCode.OVERLOADED), 2.5)
    assert error is not None
    assert error.headers == {"Retry-After": "3"}
    assert error.message == "The request was rejected (overloaded)."


def test_success_headers() -> None:
    assert oai.success_headers(reply(ReplyStatus.OK)) == {}
    degraded = reply(ReplyStatus.DEGRADED, ReasonCode.QUOTA_DEGRADED)
    assert oai.success_headers(degraded) == {"X-Seawall-Degraded": "quota_degraded"}


def test_shapes() -> None:
    done = reply(
        ReplyStatus.OK, text="hello", prompt_tokens=3, completion_tokens=2, finish_reason="length"
    )
    chat = oai.Shape(True, "r1", "default", 1, include_usage=True)
    assert chat.response(done) == {
        "id": "chatcmpl-r1",
        "object": "chat.completion",
        "created": 1,
        "model": "default",
        "choices": [
            {
                "index": 0,
                "logprobs": None,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": "hello"},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    assert chat.opening_chunk() is not None
    assert chat.chunk("he")["choices"][0]["delta"] == {"content": "he"}
    assert chat.final_chunk(done)["choices"][0] == {
        "index": 0,
        "logprobs": None,
        "finish_reason": "length",
        "delta": {},
    }
    assert chat.usage_chunk(done)["usage"]["total_tokens"] == 5
    text = oai.Shape(False, "r1", "default", 1)
    assert text.opening_chunk() is None
    assert text.response(done)["choices"][0]["text"] == "hello"
    assert text.chunk("x")["object"] == "text_completion"
    assert sse({"a": 1}) == 'data: {"a":1}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
