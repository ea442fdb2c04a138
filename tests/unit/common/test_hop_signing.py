"""MACs on the hops past ingress (``services.common.hop_signing``): what passes, what is
refused, and the secret files."""

from __future__ import annotations

import secrets
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.hop_signing import (
    HEADER,
    HopKey,
    lacks_mac,
    load_key,
    mac_headers,
    make_secret,
    secret_file,
)

KEY = HopKey("requests", secrets.token_bytes(32))
TOPIC = "llm.requests.standard"


def test_a_record_with_its_mac_passes_with_its_other_headers_kept() -> None:
    value = b'{"request_id": "r1"}'
    trace = [("traceparent", b"00-abc")]
    headers = KEY.headers(TOPIC, value, trace)
    assert headers[0] == trace[0]
    assert KEY.refusal(TOPIC, value, headers) is None


@given(st.binary(max_size=2048), st.binary(min_size=1, max_size=64))
def test_any_change_to_the_value_is_refused(value: bytes, change: bytes) -> None:
    headers = KEY.headers(TOPIC, value)
    assert KEY.refusal(TOPIC, value + change, headers) == "bad_mac"


def test_a_record_moved_to_another_topic_is_refused() -> None:
    """Moving a standard request onto the VIP topic (its class comes from the topic)."""
    value = b"request"
    headers = KEY.headers(TOPIC, value)
    assert KEY.refusal("llm.requests.vip", value, headers) == "bad_mac"


def test_another_hops_secret_or_none_is_refused() -> None:
    value = b"request"
    other = HopKey("dispatch", secrets.token_bytes(32))
    assert KEY.refusal(TOPIC, value, other.headers(TOPIC, value)) == "bad_mac"
    assert KEY.refusal(TOPIC, value, None) == "unsigned"
    assert KEY.refusal(TOPIC, value, [("traceparent", b"x")]) == "unsigned"
    assert KEY.refusal(TOPIC, value, [(HEADER, b"short")]) == "bad_mac"


def test_the_producer_and_consumer_helpers_follow_the_key_and_pass_through_without_one() -> None:
    value = b"request"
    trace = [("traceparent", b"00-abc")]
    assert mac_headers(KEY, TOPIC, value, trace) == KEY.headers(TOPIC, value, trace)
    assert mac_headers(None, TOPIC, value, trace) is trace  # signatures off: as given
    assert mac_headers(None, TOPIC, value) is None
    assert not lacks_mac(KEY, TOPIC, value, mac_headers(KEY, TOPIC, value))
    assert lacks_mac(KEY, TOPIC, value, trace)
    assert not lacks_mac(None, TOPIC, value, None)  # signatures off: nothing skipped


def test_a_tombstone_is_macced_over_no_bytes() -> None:
    assert KEY.refusal(TOPIC, None, KEY.headers(TOPIC, b"")) is None


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        HopKey("requests", b"x" * 16)


def test_secrets_made_once_owner_only(tmp_path: Path) -> None:
    make_secret(tmp_path, "dispatch")
    first = secret_file(tmp_path, "dispatch").read_text()
    make_secret(tmp_path, "dispatch")
    assert secret_file(tmp_path, "dispatch").read_text() == first
    assert stat.S_IMODE(secret_file(tmp_path, "dispatch").stat().st_mode) == 0o600
    a, b = load_key(tmp_path, "dispatch"), load_key(tmp_path, "dispatch")
    assert a.refusal(TOPIC, b"v", b.headers(TOPIC, b"v")) is None
    secret_file(tmp_path, "requests").write_text("not hex\n")
    with pytest.raises(ValueError, match="not a hop secret"):
        load_key(tmp_path, "requests")
