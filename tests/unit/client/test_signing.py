"""Record signatures (``seawall_client.signing``): any change to a signed record is
refused; the stored signing key is useless without the pepper."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seawall_client import signing

pytestmark = pytest.mark.unit

KEY = "sk-sw-0123456789ab_" + "S" * 43
KEY_ID = "0123456789ab"
NOW = 1_800_000_000.0
WINDOW = 300.0


def check(headers: list[tuple[str, bytes]], value: bytes, now: float = NOW) -> str | None:
    return signing.verify(signing.claimed(headers), value, signing.signing_key(KEY), now, WINDOW)


def test_a_signed_record_verifies_within_the_window() -> None:
    value = b'{"request_id": "r1"}'
    headers = signing.sign(KEY, KEY_ID, value, NOW)
    assert check(headers, value) is None
    assert check(headers, value, NOW + WINDOW) is None
    assert check(headers, value, NOW - WINDOW) is None
    assert check(headers, value, NOW + WINDOW + 1) == "stale_timestamp"
    assert signing.key_id_of(KEY) == KEY_ID


@given(value=st.binary(min_size=1, max_size=300), data=st.data())
def test_any_single_byte_change_is_refused(value: bytes, data: st.DataObject) -> None:
    headers = signing.sign(KEY, KEY_ID, value, NOW)
    where = data.draw(st.sampled_from(["value", *signing.HEADERS]))
    if where == "value":
        i = data.draw(st.integers(0, len(value) - 1))
        flip = data.draw(st.integers(1, 255))
        changed = value[:i] + bytes([value[i] ^ flip]) + value[i + 1 :]
        assert check(headers, changed) is not None
        return
    (raw,) = [v for n, v in headers if n == where]
    i = data.draw(st.integers(0, len(raw) - 1))
    flip = data.draw(st.integers(1, 255))
    changed_header = raw[:i] + bytes([raw[i] ^ flip]) + raw[i + 1 :]
    altered = [(n, changed_header if n == where else v) for n, v in headers]
    refusal = check(altered, value)
    # A changed digit of the timestamp may still parse: the signature covers it anyway.
    assert refusal in ("unsigned", "bad_signature", "stale_timestamp")


def test_missing_or_malformed_headers_are_unsigned() -> None:
    value = b"v"
    headers = signing.sign(KEY, KEY_ID, value, NOW)
    assert check([], value) == "unsigned"
    assert check(headers[:2], value) == "unsigned"
    bad_stamp = [(n, b"soon" if n == signing.HEADER_TIMESTAMP else v) for n, v in headers]
    assert check(bad_stamp, value) == "unsigned"
    assert signing.claimed([(n, b"\xff") for n, _ in headers]) is None


def test_another_keys_signature_is_refused() -> None:
    value = b"v"
    other = "sk-sw-0123456789ab_" + "T" * 43  # the same key id, another secret
    assert check(signing.sign(other, KEY_ID, value, NOW), value) == "bad_signature"


def test_the_stored_signing_key_needs_the_pepper() -> None:
    key = signing.signing_key(KEY)
    stored = signing.wrap(key, b"pepper", KEY_ID)
    assert bytes.fromhex(stored) != key
    assert signing.unwrap(stored, b"pepper", KEY_ID) == key
    assert signing.unwrap(stored, b"another pepper", KEY_ID) != key
    assert signing.unwrap(stored, b"pepper", "ba9876543210") != key
