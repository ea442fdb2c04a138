"""Bad input gets a DecodeError with a stable reason, never another exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import InferenceRequest
from seawall_client.serde import (
    CONTROL,
    DISPATCH,
    REPLY,
    REQUEST,
    TELEMETRY,
    DecodeError,
    decode,
    encode,
)

ADAPTERS = [REQUEST, DISPATCH, REPLY, TELEMETRY, CONTROL]
REASONS = {
    "empty_record",
    "invalid_utf8",
    "invalid_json",
    "unsupported_version",
    "schema_violation",
}
GOOD = InferenceRequest(
    request_id="r1", tenant="acme", prompt="hello", reply_to="replies", created_at=1.7e9
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=20,
)


@given(raw=st.binary(max_size=300), which=st.sampled_from(ADAPTERS))
def test_arbitrary_bytes_decode_or_fail_cleanly(raw: bytes, which: object) -> None:
    try:
        decode(which, raw)  # type: ignore[arg-type]
    except DecodeError as e:
        assert e.reason in REASONS


@given(doc=json_values, which=st.sampled_from(ADAPTERS))
def test_arbitrary_json_decodes_or_fails_cleanly(doc: object, which: object) -> None:
    try:
        decode(which, json.dumps(doc).encode())  # type: ignore[arg-type]
    except DecodeError as e:
        assert e.reason in REASONS


@given(field=st.sampled_from(sorted(InferenceRequest.model_fields)), value=json_values)
def test_mutated_requests_never_echo_their_input(field: str, value: object) -> None:
    doc = json.loads(encode(GOOD))
    secret = "sk-sw-SECRETVALUE-123"
    doc[field] = {"nested": secret} if value is None else value
    doc["prompt"] = secret if field != "prompt" else doc[field]
    try:
        decode(REQUEST, json.dumps(doc).encode())
    except DecodeError as e:
        assert secret not in e.message


def test_round_trip() -> None:
    assert decode(REQUEST, encode(GOOD)) == GOOD


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (None, "empty_record"),
        (b"\xff\xfe", "invalid_utf8"),
        (b"{not json", "invalid_json"),
        (
            json.dumps({**json.loads(encode(GOOD)), "schema_version": 9}).encode(),
            "unsupported_version",
        ),
        (b'{"type": "inference_request"}', "schema_violation"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
        (b'{"request_id": ' + b"9" * 5000 + b"}", "invalid_json"),
    ],
)
def test_reasons(raw: bytes | None, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode(REQUEST, raw)
    assert info.value.reason == reason
