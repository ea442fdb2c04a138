"""Dead letters stay small and say nothing sensitive, whatever the record held."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import DeadLetter
from schemas.deadletter import EXCERPT_BYTES, KEY_EXCERPT_BYTES
from seawall_client.serde import DecodeError, encode
from services.common.deadletters import failure_of, letter, screened_excerpt

pytestmark = pytest.mark.unit


def make(value: bytes | None, key: bytes | None = b"k") -> DeadLetter:
    return letter(
        source_topic="llm.ingress",
        partition=0,
        offset=7,
        key=key,
        value=value,
        reason="invalid_json",
        error="x" * 2000,
        service="ingress:i",
        at=1.0,
    )


@given(st.binary(max_size=3 * 1024 * 1024), st.one_of(st.none(), st.binary(max_size=4096)))
def test_a_letter_is_bounded_and_valid_whatever_the_record(value: bytes, key: bytes | None) -> None:
    item = make(value, key)
    assert len(item.excerpt) <= EXCERPT_BYTES
    assert item.key is None or len(item.key) <= KEY_EXCERPT_BYTES
    assert item.size == len(value)
    assert item.sha256 == hashlib.sha256(value).hexdigest()
    assert len(encode(item)) < 16 * 1024  # far below any producer's limit
    assert DeadLetter.model_validate_json(encode(item)) == item


def test_a_huge_record_keeps_its_first_bytes_its_size_and_digest() -> None:
    value = b'{"prompt": "' + b"a" * 900_000 + b'"}'
    item = make(value)
    assert item.excerpt == value[:EXCERPT_BYTES]
    assert item.size == len(value)


def test_no_value_means_no_digest() -> None:
    item = make(None, None)
    assert (item.excerpt, item.size, item.sha256, item.key) == (b"", 0, None, None)


def test_sensitive_data_in_the_excerpt_is_redacted() -> None:
    card = "4111 1111 1111 1111"
    value = (
        '{"prompt": "my card 4111 1111 1111 1111, 密码: hunter2, key '
        'sk-sw-0123456789ab_AbCdEfGhIjKlMnOpQrStUv"}'
    ).encode()
    excerpt = screened_excerpt(value)
    assert card.encode() not in excerpt
    assert b"hunter2" not in excerpt
    assert b"AbCdEfGhIjKlMnOpQrStUv" not in excerpt
    assert b"[REDACTED:bank_card]" in excerpt
    assert b"[REDACTED:credential]" in excerpt
    assert make(value).sha256 == hashlib.sha256(value).hexdigest()  # of the original


def test_bytes_that_are_not_text_pass_through() -> None:
    value = bytes(range(256))
    assert screened_excerpt(value) == value


def test_a_failure_is_described_without_quoting_the_record() -> None:
    assert failure_of(DecodeError("schema_violation", "prompt: too long")) == (
        "schema_violation",
        "prompt: too long",
    )
    reason, message = failure_of(ValueError("secret prompt text"))
    assert reason == "processing_error"
    assert "secret" not in message
    assert "ValueError" in message
