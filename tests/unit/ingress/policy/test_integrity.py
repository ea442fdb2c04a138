"""The MACs over key records and tenant policies: keyed by subkeys of the pepper, over
an encoding no choice of field values can make ambiguous."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.ingress.policy.integrity import (
    KEY_RECORD_LABEL,
    POLICY_LABEL,
    RecordMacs,
    canonical,
    matches,
    subkey,
)
from services.ingress.policy.keys import KeyRecord

pytestmark = pytest.mark.unit

PEPPER = b"unit-test-pepper-0123456789"
MACS = RecordMacs.from_pepper(PEPPER)
RECORD = KeyRecord(
    "0123456789ab",
    "acme",
    "ab" * 32,
    created_at=1_700_000_000.25,
    rotated_at=None,
    revoked_at=None,
    signing_key="cd" * 32,
)


def test_the_subkeys_are_derived_and_distinct_never_the_pepper() -> None:
    assert MACS.key_records == hmac.new(PEPPER, KEY_RECORD_LABEL, hashlib.sha256).digest()
    assert MACS.policies == subkey(PEPPER, POLICY_LABEL)
    assert len({PEPPER, MACS.key_records, MACS.policies}) == 3
    assert MACS.key_records != RecordMacs.from_pepper(PEPPER + b"x").key_records
    assert repr(MACS) == "RecordMacs()"  # never in a log line or a traceback


@pytest.mark.parametrize(
    "change",
    [
        {"key_id": "0123456789ac"},
        {"tenant": "acme2"},
        {"key_hash": "ac" * 32},
        {"signing_key": ""},
        {"created_at": 1_700_000_000.5},
        {"rotated_at": 1_700_000_100.0},
        {"revoked_at": 1_700_000_100.0},
    ],
)
def test_every_field_of_a_key_record_is_covered(change: dict[str, object]) -> None:
    assert MACS.key_record(replace(RECORD, **change)) != MACS.key_record(RECORD)  # type: ignore[arg-type]


def test_a_policy_covers_its_tenant_tier_and_sensitive_policy() -> None:
    base = MACS.policy("acme", "pro", "redact")
    assert base != MACS.policy("acme2", "pro", "redact")
    assert base != MACS.policy("acme", "enterprise", "redact")
    assert base != MACS.policy("acme", "pro", "block")
    assert base != MACS.policy("acme", "pro", None)
    # a policy's MAC is not a key record's, whatever the values: distinct subkeys
    assert (
        MACS.policy("acme", "pro", "redact")
        != hmac.new(
            MACS.key_records,
            canonical({"tenant": "acme", "tier": "pro", "sensitive": "redact"}),
            hashlib.sha256,
        ).hexdigest()
    )


def test_a_policy_covers_its_region_and_one_without_keeps_its_mac() -> None:
    """The region decides which regional throttles hold a tenant's Kafka requests back:
    adding, changing or removing it changes the MAC. A policy with none is MACed as
    before regions existed, so policies signed then still verify."""
    base = MACS.policy("acme", "pro", "redact")
    assert MACS.policy("acme", "pro", "redact", None) == base
    assert (
        base
        == hmac.new(
            MACS.policies,
            canonical({"tenant": "acme", "tier": "pro", "sensitive": "redact"}),
            hashlib.sha256,
        ).hexdigest()
    )
    eu = MACS.policy("acme", "pro", "redact", "eu-west")
    assert len({base, eu, MACS.policy("acme", "pro", "redact", "ap-east")}) == 3
    assert eu != MACS.policy("acme", "pro", "redact", "")  # an empty region is a value too
    # no value of one field can pass for another's
    assert eu != MACS.policy("acme", "pro", "eu-west", "redact")
    assert eu != MACS.policy("eu-west", "pro", "redact", "acme")


def test_values_that_a_plain_join_would_confuse_encode_apart() -> None:
    """``tenant="a|b", key_hash="c"`` and ``tenant="a", key_hash="b|c"`` join alike on
    ``|``; here each value is quoted and escaped."""
    one = replace(RECORD, tenant="a|b", key_hash="c")
    two = replace(RECORD, tenant="a", key_hash="b|c")
    assert MACS.key_record(one) != MACS.key_record(two)
    quoted = replace(RECORD, tenant='a","key_hash":"c')
    assert MACS.key_record(quoted) != MACS.key_record(replace(RECORD, tenant="a", key_hash="c"))


@given(
    st.dictionaries(st.text(max_size=8), st.none() | st.text(max_size=8), max_size=4),
    st.dictionaries(st.text(max_size=8), st.none() | st.text(max_size=8), max_size=4),
)
def test_the_encoding_is_injective(a: dict[str, str | None], b: dict[str, str | None]) -> None:
    assert (canonical(a) == canonical(b)) == (a == b)


def test_matches_compares_whole_macs_and_refuses_a_missing_one() -> None:
    mac = MACS.key_record(RECORD)
    assert matches(mac, mac)
    assert not matches(mac, None)
    assert not matches(mac, "")
    assert not matches(mac, mac[:-1] + ("0" if mac[-1] != "0" else "1"))
    assert not matches(mac, "é" * 64)  # not hex, not even ASCII: refused, never raises
