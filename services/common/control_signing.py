"""Signed control events: only the holder of a principal's private key can steer the
fleet as that principal.

Anyone who can produce to the control topic could otherwise suspend a tenant, open a
worker's breaker or move a canary split, and name any issuer they like. So every
control event carries an Ed25519 signature of its value by its producer's key, in two
record headers, and every follower checks it against the public keys it trusts before
the event can change anything:

- ``seawall-signer``: the principal (``controller``, ``worker``, ``operator:<name>``);
- ``seawall-control-signature``: base64 of Ed25519(private key,
  ``"seawall-control-v1\\n" + principal + "\\n" + value``).

The signature covers every byte of the value, so no field (scope, ``seq``,
``issued_at``, ``valid_for_s``, terms) changes without breaking it; the principal is
inside the signed text, so a signature cannot be moved to another signer's name. What a
principal may sign is bounded too (``authorized``): the event's ``issuer`` must be the
principal itself, except that the workers, who share the ``worker`` principal, may only
answer profiling requests about themselves (``issuer`` ``worker:<id>``). A replayed
genuine event is no more than a copy of one that was on the topic already: followers
keep the highest ``seq`` per key and refuse events dated ahead of their clock
(``services.common.control_state``).

Ed25519 rather than an HMAC: a follower holds public keys only, so a compromised
admission replica or worker still cannot issue the controller's decisions. Signing costs
about 40 µs and checking about 130 µs a record on this machine (``cryptography``), at
control-topic rates (re-publications every few seconds per decision).

Keys live in one directory (``SEAWALL_CONTROL_KEYS_DIR``): ``trusted.pub`` lists the
public keys a follower believes, one ``<principal> ed25519 <base64>`` per line, and
``<role>.key`` (owner-only) holds the private key of a process that signs, for the roles
``controller``, ``worker`` and ``operator``. ``seawall up`` makes all of them in its state
directory; a deployment mounts ``trusted.pub`` everywhere and each private key only where
its role runs (``seawall control-keys``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from aiokafka import AIOKafkaProducer
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from schemas import ControlEvent
from seawall_client.serde import encode
from services.common.secret_files import write_private
from services.common.settings import CommonSettings

HEADER_SIGNER: Final = "seawall-signer"
HEADER_SIGNATURE: Final = "seawall-control-signature"
_LABEL: Final = b"seawall-control-v1\n"
TRUSTED_FILE: Final = "trusted.pub"
Role = Literal["controller", "worker", "operator"]
ROLES: Final[tuple[Role, ...]] = ("controller", "worker", "operator")
_PRINCIPAL = re.compile(r"^(controller|worker|operator:[A-Za-z0-9._@-]{1,100})$")
_MAX_SIGNATURE_B64 = 128

Refusal = Literal["unsigned", "unknown_signer", "bad_signature", "not_authorized"]
"""Why a control event is not believed: no (or malformed) signature headers; a signer
no trusted key belongs to; a signature that is not the signer's over this value; an
event its signer may not issue (``authorized``)."""


def _message(principal: str, value: bytes) -> bytes:
    return _LABEL + principal.encode() + b"\n" + value


def check_principal(principal: str) -> str:
    if not _PRINCIPAL.match(principal):
        raise ValueError(
            f"not a control principal: {principal!r} (controller, worker or operator:<name>)"
        )
    return principal


def authorized(principal: str, event: ControlEvent) -> bool:
    """Whether ``principal`` may issue ``event``: its own name as the issuer, or, for
    the workers' shared principal, a profiling answer about the worker itself."""
    if principal == "worker":
        return (
            event.kind == "profile"
            and event.issuer.startswith("worker:")
            and event.scope == event.issuer
        )
    return event.issuer == principal


@dataclass(frozen=True, slots=True)
class ControlSigner:
    """Signs the control events of one principal."""

    principal: str
    key: Ed25519PrivateKey

    def __post_init__(self) -> None:
        check_principal(self.principal)

    def headers(self, value: bytes) -> list[tuple[str, bytes]]:
        """The record headers that sign ``value`` (the encoded event, as produced)."""
        signature = self.key.sign(_message(self.principal, value))
        return [
            (HEADER_SIGNER, self.principal.encode()),
            (HEADER_SIGNATURE, base64.b64encode(signature)),
        ]


class ControlVerifier:
    """Checks control events against the public keys it trusts."""

    def __init__(self, trusted: Mapping[str, Ed25519PublicKey]) -> None:
        for principal in trusted:
            check_principal(principal)
        self._trusted = dict(trusted)

    @property
    def principals(self) -> frozenset[str]:
        return frozenset(self._trusted)

    def check(
        self,
        value: bytes,
        headers: Sequence[tuple[str, bytes]] | None,
        event: ControlEvent,
    ) -> Refusal | None:
        """``None`` if ``event`` (decoded from ``value``) is signed by a trusted
        principal that may issue it; else why not."""
        signer = signature = None
        for name, raw in headers or ():
            if name == HEADER_SIGNER and signer is None:
                signer = raw
            elif name == HEADER_SIGNATURE and signature is None:
                signature = raw
        if signer is None or signature is None or len(signature) > _MAX_SIGNATURE_B64:
            return "unsigned"
        try:
            principal = signer.decode()
            sig = base64.b64decode(signature, validate=True)
        except (UnicodeDecodeError, binascii.Error):
            return "unsigned"
        key = self._trusted.get(principal)
        if key is None:
            return "unknown_signer"
        try:
            key.verify(sig, _message(principal, value))
        except InvalidSignature:
            return "bad_signature"
        if not authorized(principal, event):
            return "not_authorized"
        return None


# -- keys on disk ----------------------------------------------------------------


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def public_line(principal: str, key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return f"{check_principal(principal)} ed25519 {_b64(raw)}"


def parse_trusted(text: str) -> dict[str, Ed25519PublicKey]:
    """``<principal> ed25519 <base64>`` lines (``#`` comments, blank lines skipped)."""
    trusted: dict[str, Ed25519PublicKey] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3 or parts[1] != "ed25519":
            raise ValueError(f"{TRUSTED_FILE} line {number}: <principal> ed25519 <base64>")
        principal = check_principal(parts[0])
        try:
            trusted[principal] = Ed25519PublicKey.from_public_bytes(base64.b64decode(parts[2]))
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{TRUSTED_FILE} line {number}: not an Ed25519 key") from e
    return trusted


def load_verifier(keys_dir: Path) -> ControlVerifier:
    return ControlVerifier(parse_trusted((keys_dir / TRUSTED_FILE).read_text()))


def load_signer(keys_dir: Path, role: Role) -> ControlSigner:
    """The private key of ``role`` in ``keys_dir`` (``<role>.key``: ``principal <name>``
    and ``ed25519 <base64 of the 32-byte seed>``)."""
    path = keys_dir / f"{role}.key"
    fields = dict(
        line.split(None, 1) for line in path.read_text().splitlines() if " " in line.strip()
    )
    try:
        principal = fields["principal"].strip()
        seed = base64.b64decode(fields["ed25519"].strip(), validate=True)
        return ControlSigner(principal, Ed25519PrivateKey.from_private_bytes(seed))
    except (KeyError, ValueError, binascii.Error) as e:
        raise ValueError(f"{path}: not a control signing key ({e})") from e


def make_key(keys_dir: Path, role: Role, principal: str) -> ControlSigner:
    """A new private key for ``role`` signing as ``principal`` in ``keys_dir`` (which
    must not hold one already), added to ``trusted.pub``."""
    check_principal(principal)
    if role != "operator" and principal != role:
        raise ValueError(f"the {role} role signs as {role!r}, not {principal!r}")
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    write_private(keys_dir / f"{role}.key", f"principal {principal}\ned25519 {_b64(seed)}\n")
    trust(keys_dir, [(principal, key.public_key())])
    return ControlSigner(principal, key)


def trust(keys_dir: Path, keys: Iterable[tuple[str, Ed25519PublicKey]]) -> None:
    """Add (or replace) public keys in ``keys_dir``'s ``trusted.pub``."""
    path = keys_dir / TRUSTED_FILE
    current = parse_trusted(path.read_text()) if path.exists() else {}
    current.update(keys)
    lines = [public_line(p, k) for p, k in sorted(current.items())]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def ensure_keys(keys_dir: Path, operator: str) -> None:
    """Every role's key in ``keys_dir``, made where missing (``seawall up``,
    ``seawall control-keys``): the controller's, the workers', and an operator's signing
    as ``operator``; and the secrets of the signed hops (``services.common.hop_signing``)."""
    from services.common.hop_signing import HOPS, make_secret

    for role in ROLES:
        if not (keys_dir / f"{role}.key").exists():
            make_key(keys_dir, role, operator if role == "operator" else role)
    for hop in HOPS:
        make_secret(keys_dir, hop)


# -- from a process's settings -----------------------------------------------------


class ControlKeysMissing(RuntimeError):
    """Control signatures are required and this process has no keys to use."""


def keys_dir(settings: CommonSettings, needed: str) -> Path | None:
    """The keys directory of a process that needs the file ``needed`` from it; ``None``
    where signatures are off; ``ControlKeysMissing`` where none is set."""
    if settings.control_signatures == "off":
        return None
    if settings.control_keys_dir is None:
        raise ControlKeysMissing(
            "internal records must be signed: set SEAWALL_CONTROL_KEYS_DIR to the directory "
            f"holding {needed} (seawall control-keys), or SEAWALL_CONTROL_SIGNATURES=off "
            "for a throwaway stack"
        )
    return settings.control_keys_dir


def verifier_for(settings: CommonSettings) -> ControlVerifier | None:
    """The verifier a follower checks every control event with; ``None`` where
    signatures are off."""
    found = keys_dir(settings, TRUSTED_FILE)
    return None if found is None else load_verifier(found)


def signer_for(settings: CommonSettings, role: Role) -> ControlSigner | None:
    """The signer of a process that issues control events as ``role``; ``None`` where
    signatures are off."""
    found = keys_dir(settings, f"{role}.key")
    return None if found is None else load_signer(found, role)


async def send_signed(
    producer: AIOKafkaProducer,
    topic: str,
    events: Iterable[ControlEvent],
    signer: ControlSigner | None,
) -> None:
    """Produce ``events`` on the control topic ``topic``, each keyed by its control key
    and signed (``signer``; none where signatures are off); wait for every ack."""
    sends = []
    for event in events:
        value = encode(event)
        sends.append(
            await producer.send(
                topic,
                value,
                key=event.control_key.encode(),
                headers=None if signer is None else signer.headers(value),
            )
        )
    await asyncio.gather(*sends)
