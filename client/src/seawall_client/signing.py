"""Signed records on the ingress topic: a producer proves it holds its API key without
putting the key on the topic (pure: no I/O; time is passed in).

Modelled on AWS SigV4 and Stripe's webhook signatures. The recipe, which a producer in
any language can follow (README, "Producing to llm.ingress"; it is also in the JSON
Schemas of ``InferenceRequest`` and ``AbortRequest``):

1. ``signing_key = HMAC-SHA256(key = the API key's UTF-8 bytes,
   message = "seawall-record-signing-v1")`` — 32 bytes, derived once per key.
2. ``canonical = "seawall-record-v1\\n" + timestamp + "\\n" + key_id + "\\n" +
   hex(SHA-256(value))``: ``timestamp`` the Unix time in whole seconds (decimal),
   ``key_id`` the 12 hex characters of the key (``sk-sw-<key id>_…``), ``value`` the
   record's value bytes exactly as produced.
3. ``signature = "v1=" + hex(HMAC-SHA256(key = signing_key, message = canonical))``.
4. Record headers: ``seawall-key-id``, ``seawall-timestamp``, ``seawall-signature``
   (UTF-8 bytes of the strings above).

The digest covers every byte of the value (request id, tenant-visible fields, prompt),
so no field can change without breaking the signature. Ingress checks the signature in
constant time, the timestamp against a window (a replay of an old record fails it),
and, per request id, that no other record carried it (a replay within the window).

The header names and labels are the wire contract's (``schemas.signed``). The server
never keeps the API key: it keeps the signing key, *wrapped* — XORed with
``HMAC-SHA256(pepper, "seawall-signing-key-wrap:" + key_id)`` — so that, like the key
hashes, a copy of Redis is of no use without the server's pepper.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from schemas.signed import (
    CANONICAL_PREFIX,
    HEADER_KEY_ID,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    SIGNATURE_VERSION,
    SIGNING_LABEL,
)

KEY_PREFIX = "sk-sw-"
"""API keys look like ``sk-sw-<key id>_<secret>``: the key id is 12 hex characters."""
_KEY = re.compile(rf"{re.escape(KEY_PREFIX)}(?P<id>[0-9a-f]{{12}})_[A-Za-z0-9_-]{{16,}}")
HEADERS = (HEADER_KEY_ID, HEADER_TIMESTAMP, HEADER_SIGNATURE)
_SIGNING_LABEL = SIGNING_LABEL.encode()
_WRAP_LABEL = b"seawall-signing-key-wrap:"

Refusal = Literal["unsigned", "bad_signature", "stale_timestamp"]
"""Why a record's signature is not accepted: no (or malformed) signing headers; a
signature that is not the key's over this record; a timestamp outside the window."""


def key_id_of(presented: str) -> str | None:
    """The key id of a well-formed API key, ``None`` otherwise (look nothing up then)."""
    m = _KEY.fullmatch(presented)
    return m.group("id") if m else None


def signing_key(api_key: str) -> bytes:
    """The key a producer signs with, derived from its API key."""
    return hmac.new(api_key.encode(), _SIGNING_LABEL, hashlib.sha256).digest()


def canonical(key_id: str, timestamp: int, value: bytes) -> bytes:
    digest = hashlib.sha256(value).hexdigest()
    return f"{CANONICAL_PREFIX}\n{timestamp}\n{key_id}\n{digest}".encode()


def signature(key: bytes, key_id: str, timestamp: int, value: bytes) -> str:
    mac = hmac.new(key, canonical(key_id, timestamp, value), hashlib.sha256).hexdigest()
    return f"{SIGNATURE_VERSION}={mac}"


def sign(api_key: str, key_id: str, value: bytes, now: float) -> list[tuple[str, bytes]]:
    """The headers of a record with ``value``, signed with ``api_key`` at ``now``."""
    timestamp = int(now)
    return [
        (HEADER_KEY_ID, key_id.encode()),
        (HEADER_TIMESTAMP, str(timestamp).encode()),
        (HEADER_SIGNATURE, signature(signing_key(api_key), key_id, timestamp, value).encode()),
    ]


@dataclass(frozen=True, slots=True)
class Claimed:
    """What a record's headers claim, before anything is verified."""

    key_id: str
    timestamp: int
    signature: str


def claimed(headers: Iterable[tuple[str, bytes]] | None) -> Claimed | None:
    """The signing headers of a record; ``None`` when any is missing or malformed."""
    found: dict[str, str] = {}
    for name, raw in headers or ():
        if name in HEADERS and name not in found:
            try:
                found[name] = raw.decode("ascii")
            except (UnicodeDecodeError, AttributeError):
                return None
    if set(found) != set(HEADERS):
        return None
    stamp = found[HEADER_TIMESTAMP]
    if not stamp.isdigit() or len(stamp) > 12:
        return None
    return Claimed(found[HEADER_KEY_ID], int(stamp), found[HEADER_SIGNATURE])


def verify(
    claim: Claimed | None, value: bytes, key: bytes, now: float, window_s: float
) -> Refusal | None:
    """``None`` if ``claim`` is a valid signature by ``key`` of ``value`` within
    ``window_s`` of ``now``; else why not. The signature is compared in constant time,
    and before the timestamp, so a stale record with a wrong signature says only that."""
    if claim is None:
        return "unsigned"
    expected = signature(key, claim.key_id, claim.timestamp, value)
    if not hmac.compare_digest(expected.encode(), claim.signature.encode()):
        return "bad_signature"
    if abs(now - claim.timestamp) > window_s:
        return "stale_timestamp"
    return None


def _pad(pepper: bytes, key_id: str) -> bytes:
    return hmac.new(pepper, _WRAP_LABEL + key_id.encode(), hashlib.sha256).digest()


def wrap(key: bytes, pepper: bytes, key_id: str) -> str:
    """The signing key as the key store keeps it (hex), useless without the pepper."""
    return bytes(a ^ b for a, b in zip(key, _pad(pepper, key_id), strict=True)).hex()


def unwrap(stored: str, pepper: bytes, key_id: str) -> bytes:
    return bytes(a ^ b for a, b in zip(bytes.fromhex(stored), _pad(pepper, key_id), strict=True))
