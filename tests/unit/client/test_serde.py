"""Bad input gets a DecodeError with a stable reason, never another exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from schemas import (
    ChatMessage,
    Degradation,
    DispatchedRequest,
    InferenceRequest,
    SamplingParams,
    ShadowOrder,
)
from seawall_client.serde import (
    CONTROL,
    DISPATCH,
    REPLY,
    REQUEST,
    TELEMETRY,
    DecodeError,
    decode,
    encode,
    encode_with,
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


idents = st.from_regex(r"[A-Za-z0-9._:@/-]{1,16}", fullmatch=True)
inputs = st.one_of(
    st.builds(dict, prompt=st.text(max_size=40)),
    st.builds(dict, messages=st.just((ChatMessage(role="user", content="hi"),))),
)
requests = st.builds(
    lambda given, **fields: InferenceRequest(**given, **fields),
    inputs,
    request_id=idents,
    tenant=idents,
    sampling=st.builds(
        SamplingParams,
        max_tokens=st.integers(1, 32_768),
        temperature=st.floats(0, 2),
        seed=st.none() | st.integers(0, 2**63 - 1),
    ),
    stream=st.booleans(),
    reply_to=st.from_regex(r"[a-z0-9._-]{1,20}", fullmatch=True),
    created_at=st.floats(0, 2e9),
    session_id=st.none() | idents,
    prompt_tokens=st.none() | st.integers(0, 10_000),
)


@st.composite
def as_carried(draw: st.DrawFn, request: InferenceRequest) -> bytes:
    """``request`` as a record may carry it: compact or spaced, defaults written or
    left out, its keys in any order."""
    doc = request.model_dump(mode="json", exclude_defaults=draw(st.booleans()))
    keys = draw(st.permutations(sorted(doc)))
    spaced = draw(st.booleans())
    return json.dumps(
        {k: doc[k] for k in keys}, separators=(", ", ": ") if spaced else (",", ":")
    ).encode()


@given(data=st.data(), request=requests, level=st.integers(0, 3), shadow=st.booleans())
def test_a_dispatch_written_around_its_requests_bytes_decodes_as_if_encoded_whole(
    data: st.DataObject, request: InferenceRequest, level: int, shadow: bool
) -> None:
    raw = data.draw(as_carried(request))
    read = decode(REQUEST, raw)
    dispatch = DispatchedRequest(
        request=read,
        pool="small",
        degradation=Degradation(level=level),
        admitted_at=1.7e9,
        shadow=ShadowOrder(pool="main", min_similarity=0.5) if shadow else None,
    )
    spliced = decode(DISPATCH, encode_with(dispatch, "request", raw))
    assert spliced == dispatch == decode(DISPATCH, encode(dispatch))


class _OneField(BaseModel):
    only: int


def test_a_message_with_no_other_field_is_written_with_no_stray_comma() -> None:
    assert encode_with(_OneField(only=7), "only", b"7") == b'{"only":7}'
