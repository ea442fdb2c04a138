"""``seawall submit``'s pure parts: the key it signs with, what the request carries, the
summary line."""

from __future__ import annotations

import pytest

from schemas import ChatMessage, InferenceReply, ReasonCode, ReplyStatus
from seawall.submit import Submitted, check_key, request_input, summary_line
from services.ingress.policy.keys import generate_key

pytestmark = pytest.mark.unit


def test_the_key_is_checked_before_anything_is_sent() -> None:
    issued = generate_key("acme", 0.0, b"pepper")
    assert check_key(issued.key) == issued.key


@pytest.mark.parametrize(
    ("key", "match"),
    [
        (None, "give --key"),
        ("not-a-key", "not a seawall key"),
        ("0123456789ab", "not a seawall key"),  # a key id is not enough: records are signed
        ("sk-sw-short_secret", "not a seawall key"),
    ],
)
def test_what_is_no_key(key: str | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_key(key)


def test_request_input() -> None:
    assert request_input("hi", None, None) == ("hi", None)
    assert request_input("hi", "be brief", None) == (
        None,
        [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")],
    )
    assert request_input(None, None, '[{"role": "user", "content": "yo"}]') == (
        None,
        [ChatMessage(role="user", content="yo")],
    )


@pytest.mark.parametrize(
    ("prompt", "system", "messages", "match"),
    [
        (None, None, None, "give a prompt"),
        (None, "sys", None, "give a prompt"),
        ("hi", None, "[]", "takes the place"),
        (None, None, "[]", "at least one"),
        (None, None, '[{"role": "wizard", "content": "x"}]', "messages-json"),
        (None, None, "not json", "messages-json"),
    ],
)
def test_request_input_refuses(
    prompt: str | None, system: str | None, messages: str | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        request_input(prompt, system, messages)


def test_summary_line() -> None:
    ok = InferenceReply(
        request_id="r1",
        status=ReplyStatus.OK,
        prompt_tokens=3,
        completion_tokens=12,
        worker_id="worker-main-0",
        completed_at=1.0,
    )
    assert summary_line(Submitted(ok, 0.0351, 0.4104, 1)) == (
        "status=ok reason=none prompt_tokens=3 completion_tokens=12 ttft_ms=35 latency_ms=410 "
        "worker=worker-main-0 attempts=1"
    )
    rejected = InferenceReply(
        request_id="r1.3",
        status=ReplyStatus.REJECTED,
        reason=ReasonCode.QUOTA_EXCEEDED,
        message='over "quota"',
        completed_at=1.0,
    )
    assert summary_line(Submitted(rejected, None, 1.5, 3)) == (
        "status=rejected reason=quota_exceeded prompt_tokens=0 completion_tokens=0 ttft_ms=- "
        'latency_ms=1500 worker=- attempts=3 message="over \\"quota\\""'
    )
