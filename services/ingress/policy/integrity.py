"""MACs over the records in Redis that decide who an API key speaks for, pure.

A key record says which tenant a key belongs to and whether it still works
(``revoked_at``, its dates); a tenant's policy says its tier (its quotas) and what
happens to sensitive data in its prompts, and its region (where its Kafka requests
count, and which regional throttles hold them back). Whoever can write Redis but does
not hold the pepper could otherwise move a key to another tenant, clear a revocation,
raise a tier or move a tenant out of a throttled region. Each record therefore carries
``mac``: hex HMAC-SHA-256 over a canonical encoding of every field that decides
something, under a key derived from the pepper — one subkey per kind of record
(``HMAC(pepper, label)``), never the pepper itself, so a MAC can neither be mistaken for
a key hash (also keyed by the pepper) nor moved from a key record to a policy. Each
record's MAC also covers its own name (key id or tenant), so it cannot be copied onto
another record of the same kind.

The encoding is JSON with sorted keys and no spaces, ASCII only: each value is
quoted and escaped, so no choice of values (a tenant holding ``|``, a date holding a
comma) can make two different records encode alike, as a plain join could. Dates are
encoded as Python writes a float (``repr``), the way the store writes them; an absent
date is ``null``, distinct from every date. A policy's region is in the encoding only
when it has one: policies signed before tenants had regions keep verifying, and adding,
changing or removing a region all change the encoding (a key present or absent), so
each fails the MAC.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.ingress.policy.keys import KeyRecord

KEY_RECORD_LABEL = b"seawall-key-record-mac-v1"
POLICY_LABEL = b"seawall-tenant-policy-mac-v1"


def subkey(pepper: bytes, label: bytes) -> bytes:
    """A key for one purpose, derived from the pepper (HMAC-SHA-256 as a PRF)."""
    return hmac.new(pepper, label, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class RecordMacs:
    """The MAC keys of both kinds of record, derived once from the pepper."""

    key_records: bytes = field(repr=False)
    policies: bytes = field(repr=False)

    @classmethod
    def from_pepper(cls, pepper: bytes) -> RecordMacs:
        return cls(subkey(pepper, KEY_RECORD_LABEL), subkey(pepper, POLICY_LABEL))

    def key_record(self, record: KeyRecord) -> str:
        """The MAC of a key record: its id, tenant, key hash, wrapped signing key and
        every lifecycle date. (The tier is not the key's but its tenant's: see
        ``policy``.)"""
        return _mac(
            self.key_records,
            {
                "key_id": record.key_id,
                "tenant": record.tenant,
                "key_hash": record.key_hash,
                "signing_key": record.signing_key,
                "created_at": _date(record.created_at),
                "rotated_at": _date(record.rotated_at),
                "revoked_at": _date(record.revoked_at),
            },
        )

    def policy(
        self, tenant: str, tier: str, sensitive: str | None, region: str | None = None
    ) -> str:
        """The MAC of a tenant's policy; ``sensitive`` ``None`` when the record has none
        (the store's default applies then), ``region`` ``None`` when it has none (its
        Kafka requests then come from no region)."""
        fields = {"tenant": tenant, "tier": tier, "sensitive": sensitive}
        if region is not None:
            fields["region"] = region
        return _mac(self.policies, fields)


def canonical(fields: Mapping[str, str | None]) -> bytes:
    return json.dumps(
        dict(fields), sort_keys=True, separators=(",", ":"), ensure_ascii=True
    ).encode()


def matches(expected: str, stored: str | None) -> bool:
    """Whether the stored MAC is the expected one, compared in constant time."""
    if stored is None:
        return False
    return hmac.compare_digest(expected.encode(), stored.encode())


def _mac(key: bytes, fields: Mapping[str, str | None]) -> str:
    return hmac.new(key, canonical(fields), hashlib.sha256).hexdigest()


def _date(value: float | None) -> str | None:
    return None if value is None else repr(value)
