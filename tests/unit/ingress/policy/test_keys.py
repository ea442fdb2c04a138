"""API key lifecycle: format, hashing, phases and rights."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seawall_client.signing import KEY_PREFIX, key_id_of
from services.ingress.policy.keys import (
    DAY_S,
    DEFAULT_POLICY,
    Action,
    check,
    disabled_at,
    generate_key,
    hash_key,
    phase,
    rotate,
    verify,
)

pytestmark = pytest.mark.unit

PEPPER = b"server-pepper"
T0 = 1_700_000_000.0
ACTIONS: tuple[Action, ...] = ("inference", "read", "create_key", "rotate_key", "revoke_key")


def test_generated_keys_are_recognisable_and_stored_hashed() -> None:
    issued = generate_key("acme", T0, PEPPER)
    assert issued.key.startswith(KEY_PREFIX)
    assert key_id_of(issued.key) == issued.record.key_id
    assert issued.record.key_hash == hash_key(issued.key, PEPPER)
    assert issued.key not in repr(issued)
    assert issued.key not in repr(issued.record)
    assert issued.record.key_hash not in repr(issued.record)
    assert generate_key("acme", T0, PEPPER).key != issued.key


def test_verify() -> None:
    issued = generate_key("acme", T0, PEPPER)
    assert verify(issued.key, issued.record, PEPPER)
    assert not verify(issued.key, issued.record, b"other-pepper")
    assert not verify(
        issued.key[:-1] + ("A" if issued.key[-1] != "A" else "B"), issued.record, PEPPER
    )


@pytest.mark.parametrize(
    "presented",
    [
        "",
        "sk-sw-",
        "sk-sw-abc_def",
        "sk-sw-0123456789ab",
        "Bearer sk-sw-0123456789ab_" + "x" * 43,
        "sk-sw-0123456789AB_" + "x" * 43,
        "sk-sw-0123456789ab_short",
    ],
)
def test_malformed_keys_have_no_id(presented: str) -> None:
    assert key_id_of(presented) is None


def phase_at(days: float) -> str:
    return phase(generate_key("t", T0, PEPPER).record, T0 + days * DAY_S)


@pytest.mark.parametrize(
    ("days", "expected"),
    [
        (0, "active"),
        (89.99, "active"),
        (90, "grace"),
        (96.99, "grace"),
        (97, "retired"),
        (126.99, "retired"),
        (127, "purged"),
        (-1, "active"),
    ],
)
def test_phases_from_creation(days: float, expected: str) -> None:
    assert phase_at(days) == expected


@given(st.floats(0, 200 * DAY_S), st.sampled_from(ACTIONS))
def test_rights_by_phase(age: float, action: Action) -> None:
    record = generate_key("t", T0, PEPPER).record
    decision = check(record, action, T0 + age)
    p = phase(record, T0 + age)
    assert decision.phase == p
    assert decision.disabled_at == T0 + 97 * DAY_S
    if p == "active":
        assert decision.allowed
        assert decision.reason == "ok"
    elif p == "grace":
        read_only = action in ("inference", "read")
        assert decision.allowed == read_only
        assert decision.reason == ("key_in_grace" if read_only else "key_read_only")
    else:
        assert not decision.allowed
        assert decision.reason == {"retired": "key_retired", "purged": "key_purged"}[p]


def test_revocation_disables_at_once_then_purges() -> None:
    record = replace(generate_key("t", T0, PEPPER).record, revoked_at=T0 + 10)
    assert check(record, "inference", T0 + 9).allowed
    late = check(record, "read", T0 + 10)
    assert (late.allowed, late.reason, late.phase) == (False, "key_revoked", "revoked")
    assert disabled_at(record) == T0 + 10
    assert phase(record, T0 + 10 + DEFAULT_POLICY.retired_s) == "purged"


def test_rotation_starts_the_old_keys_grace() -> None:
    old = generate_key("t", T0, PEPPER).record
    rotated, new = rotate(old, T0 + DAY_S, PEPPER)
    assert new.record.tenant == "t"
    assert new.record.key_id != old.key_id
    assert phase(rotated, T0 + DAY_S) == "grace"
    assert check(rotated, "inference", T0 + 2 * DAY_S).reason == "key_in_grace"
    assert phase(rotated, T0 + 8 * DAY_S) == "retired"
    with pytest.raises(PermissionError, match="key_read_only"):
        rotate(rotated, T0 + 2 * DAY_S, PEPPER)
