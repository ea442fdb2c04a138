"""API key lifecycle (DESIGN, "API keys"), pure: no store, no clock (``now`` is passed).

Keys look like ``sk-sw-<key id>_<secret>``: the prefix makes a leaked key recognisable
to secret scanners, the key id (12 hex characters, not secret) names the key in the
store, in audit events and in logs, and the secret is 256 random bits. Only
``hash_key``'s HMAC-SHA-256 under a server pepper is stored: with 256-bit secrets a
plain hash would already be unguessable, and the pepper makes a leaked table of hashes
useless without the server's secret. Verification compares in constant time. Beside it
the store keeps the key's record-signing key, wrapped under the pepper too
(``seawall_client.signing``): what verifying a signed Kafka record needs, no more.

Phases, counted from creation (or from rotation, which ends the active phase early):

| phase   | lasts   | may                                                        |
|---------|---------|------------------------------------------------------------|
| active  | 90 days | everything                                                 |
| grace   | 7 days  | read-only: inference and reads, answered with a deprecation |
|         |         | warning (``Deprecation``/``Sunset`` headers); no key        |
|         |         | creation, rotation or revocation with this key              |
| retired | 30 days | nothing; the record is kept for the audit trail             |
| purged  | —       | nothing; the record is due for deletion                     |

Inference counts as read-only: it creates nothing durable on the tenant's account, and
refusing it would turn a missed rotation into an outage. A revoked key is disabled at
once and purged ``retired_s`` after its revocation.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field, replace
from typing import Literal

from seawall_client import signing
from seawall_client.signing import KEY_PREFIX

DAY_S = 86_400.0

Phase = Literal["active", "grace", "retired", "purged", "revoked"]
Action = Literal["inference", "read", "create_key", "rotate_key", "revoke_key"]
KeyReason = Literal[
    "ok", "key_in_grace", "key_read_only", "key_retired", "key_purged", "key_revoked"
]

_READ_ONLY: frozenset[Action] = frozenset({"inference", "read"})
_DISABLED: dict[Phase, KeyReason] = {
    "retired": "key_retired",
    "purged": "key_purged",
    "revoked": "key_revoked",
}


@dataclass(frozen=True, slots=True)
class LifecyclePolicy:
    active_s: float = 90 * DAY_S
    grace_s: float = 7 * DAY_S
    retired_s: float = 30 * DAY_S


DEFAULT_POLICY = LifecyclePolicy()


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """What the store keeps: never the key itself."""

    key_id: str
    tenant: str
    key_hash: str = field(repr=False)
    created_at: float
    rotated_at: float | None = None
    """Set when the key was replaced; its grace period starts then."""
    revoked_at: float | None = None
    signing_key: str = field(default="", repr=False)
    """The key records on the ingress topic are signed with, wrapped under the pepper
    (``seawall_client.signing``); empty for a key issued before records were signed
    (rotate it to produce to the ingress topic)."""


@dataclass(frozen=True, slots=True)
class IssuedKey:
    record: KeyRecord
    key: str = field(repr=False)
    """The full key: shown to its owner once, then forgotten."""


@dataclass(frozen=True, slots=True)
class KeyDecision:
    allowed: bool
    reason: KeyReason
    phase: Phase
    disabled_at: float
    """When the key stops working (the ``Sunset`` header during grace)."""


def hash_key(key: str, pepper: bytes) -> str:
    return hmac.new(pepper, key.encode(), hashlib.sha256).hexdigest()


def generate_key(tenant: str, now: float, pepper: bytes) -> IssuedKey:
    key_id = secrets.token_hex(6)
    key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    wrapped = signing.wrap(signing.signing_key(key), pepper, key_id)
    return IssuedKey(
        KeyRecord(key_id, tenant, hash_key(key, pepper), now, signing_key=wrapped), key
    )


def verify(presented: str, record: KeyRecord, pepper: bytes) -> bool:
    """Whether ``presented`` is the key behind ``record`` (constant-time comparison)."""
    return hmac.compare_digest(hash_key(presented, pepper), record.key_hash)


def disabled_at(record: KeyRecord, policy: LifecyclePolicy = DEFAULT_POLICY) -> float:
    if record.revoked_at is not None:
        return record.revoked_at
    return _active_until(record, policy) + policy.grace_s


def _active_until(record: KeyRecord, policy: LifecyclePolicy) -> float:
    end = record.created_at + policy.active_s
    return end if record.rotated_at is None else min(end, record.rotated_at)


def phase(record: KeyRecord, now: float, policy: LifecyclePolicy = DEFAULT_POLICY) -> Phase:
    if record.revoked_at is not None and now >= record.revoked_at:
        return "purged" if now >= record.revoked_at + policy.retired_s else "revoked"
    active_until = _active_until(record, policy)
    if now < active_until:
        return "active"
    if now < active_until + policy.grace_s:
        return "grace"
    if now < active_until + policy.grace_s + policy.retired_s:
        return "retired"
    return "purged"


def check(
    record: KeyRecord, action: Action, now: float, policy: LifecyclePolicy = DEFAULT_POLICY
) -> KeyDecision:
    """May this key do ``action`` now? Denials carry a reason code, never the key."""
    p = phase(record, now, policy)
    until = disabled_at(record, policy)
    if p == "active":
        return KeyDecision(True, "ok", p, until)
    if p == "grace":
        if action in _READ_ONLY:
            return KeyDecision(True, "key_in_grace", p, until)
        return KeyDecision(False, "key_read_only", p, until)
    return KeyDecision(False, _DISABLED[p], p, until)


def rotate(
    record: KeyRecord, now: float, pepper: bytes, policy: LifecyclePolicy = DEFAULT_POLICY
) -> tuple[KeyRecord, IssuedKey]:
    """Replace a key, authorised by that key: the old one enters its grace period now.

    Raises ``PermissionError`` (with the reason code) unless the key may rotate.
    """
    decision = check(record, "rotate_key", now, policy)
    if not decision.allowed:
        raise PermissionError(decision.reason)
    return replace(record, rotated_at=now), generate_key(record.tenant, now, pepper)
