"""Signed hops inside the bus: a record on a priority topic (``llm.requests.*``) carries
ingress's MAC, a record on a dispatch topic (``llm.dispatch.*``) admission's (or a
worker's, for a shadow), a quota hint (``llm.quota.hints``) admission's, a worker report
or completion (``llm.telemetry``, ``llm.completions``) a worker's, and the consumer
checks it before acting on the record.

Without it, anyone who can produce to those topics skips every check at the edge: a
record on ``llm.requests.vip`` is admitted as VIP for whatever tenant it names, one on a
dispatch topic is served on a GPU with no quota charged. The signed Kafka edge
(``seawall_client.signing``) proves a tenant's key on ``llm.ingress``; these MACs prove
that the record past the edge was written by the service whose hop it is.

``seawall-hop-mac`` = HMAC-SHA256(hop secret, topic + ``"\\n"`` + value), the raw 32
bytes. The topic is inside the MAC, so a record cannot be moved to another priority or
pool. One secret per hop, 32 random bytes in hex, in the keys directory
(``SEAWALL_CONTROL_KEYS_DIR``, beside the control keys): ``requests.hmac`` (ingress
writes, admission reads), ``dispatch.hmac`` (admission and the workers write, the
workers read), ``hints.hmac`` (admission writes, ingress reads: a forged hint would
refuse a tenant at the edge until it expires) and ``telemetry.hmac`` (the workers
write ``llm.telemetry`` and ``llm.completions``, admission and the controller read: a
forged report would steer the pacing and the breakers, a forged completion refund a
tenant's tokens). An HMAC rather than a signature: it is
one keyed hash a record (a couple of microseconds for a request's bytes, against 40 µs
to sign and 130 µs to check Ed25519 on this machine), and each secret is shared only by
the two sides of its hop, so a compromised worker cannot forge what admission reads. A
worker can forge a dispatch (the workers write shadows): it already serves whatever is
dispatched to it.

A record that fails is no request: it is counted (``seawall_hop_refused_total``),
logged at most every 10 s, and skipped without a dead letter (its producer is not a
tenant to answer, and a forged flood must cost its sender more than us).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final, Literal

from prometheus_client import Counter

from services.common.secret_files import make_hex_secret
from services.common.settings import CommonSettings

log = logging.getLogger(__name__)

HEADER: Final = "seawall-hop-mac"
Hop = Literal["requests", "dispatch", "hints", "telemetry"]
HOPS: Final[tuple[Hop, ...]] = ("requests", "dispatch", "hints", "telemetry")
LOG_EVERY_S: Final = 10.0

REFUSED = Counter(
    "seawall_hop_refused_total",
    "Records on a priority, dispatch, quota-hint, telemetry or completion topic without "
    "a valid MAC of their hop "
    "(services.common.hop_signing): skipped",
    ["hop", "reason"],
)


class HopKey:
    """The secret of one hop: MACs records for it and checks them."""

    def __init__(self, hop: Hop, secret: bytes) -> None:
        if len(secret) < 32:
            raise ValueError(f"the {hop} hop's secret must be at least 32 bytes")
        self.hop = hop
        self._secret = secret
        self._logged: dict[str, float] = {}

    def mac(self, topic: str, value: bytes) -> bytes:
        return hmac.digest(self._secret, topic.encode() + b"\n" + value, "sha256")

    def headers(
        self, topic: str, value: bytes, more: Sequence[tuple[str, bytes]] | None = None
    ) -> list[tuple[str, bytes]]:
        """``more`` (a trace context, say) and the MAC of ``value`` on ``topic``."""
        return [*(more or ()), (HEADER, self.mac(topic, value))]

    def refusal(
        self, topic: str, value: bytes | None, headers: Sequence[tuple[str, bytes]] | None
    ) -> str | None:
        """``None`` if the record carries this hop's MAC for its topic and value; else
        why not (``unsigned``, ``bad_mac``), counted and, at most every 10 s, logged."""
        got = next((raw for name, raw in headers or () if name == HEADER), None)
        if got is None:
            reason = "unsigned"
        elif not hmac.compare_digest(got, self.mac(topic, value or b"")):
            reason = "bad_mac"
        else:
            return None
        REFUSED.labels(self.hop, reason).inc()
        now = time.monotonic()
        if now - self._logged.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[reason] = now
            log.warning(
                "a record without its hop's MAC was skipped",
                extra={"hop": self.hop, "topic": topic, "reason": reason},
            )
        return reason


def mac_headers(
    hop: HopKey | None,
    topic: str,
    value: bytes,
    more: list[tuple[str, bytes]] | None = None,
) -> list[tuple[str, bytes]] | None:
    """A producer's headers for a record of ``hop``: ``more`` (a trace context, say)
    and the MAC of ``value`` on ``topic``; ``more`` alone where signatures are off
    (``hop`` is None)."""
    return more if hop is None else hop.headers(topic, value, more)


def lacks_mac(
    hop: HopKey | None,
    topic: str,
    value: bytes | None,
    headers: Sequence[tuple[str, bytes]] | None,
) -> bool:
    """Whether a consumer must skip a record for want of ``hop``'s MAC (counted and
    logged by ``HopKey.refusal``); never where signatures are off (``hop`` is None)."""
    return hop is not None and hop.refusal(topic, value, headers) is not None


def secret_file(keys_dir: Path, hop: Hop) -> Path:
    return keys_dir / f"{hop}.hmac"


def make_secret(keys_dir: Path, hop: Hop) -> None:
    """A new random secret for ``hop`` in ``keys_dir`` (owner-only), if there is none."""
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    make_hex_secret(secret_file(keys_dir, hop))


def load_key(keys_dir: Path, hop: Hop) -> HopKey:
    path = secret_file(keys_dir, hop)
    try:
        return HopKey(hop, bytes.fromhex(path.read_text().strip()))
    except ValueError as e:
        raise ValueError(f"{path}: not a hop secret ({e})") from e


def hop_key_for(settings: CommonSettings, hop: Hop) -> HopKey | None:
    """The secret of ``hop`` for a service that writes or reads it; ``None`` where
    signatures are off (``control_signatures``)."""
    from services.common.control_signing import keys_dir

    found = keys_dir(settings, secret_file(Path(), hop).name)
    return None if found is None else load_key(found, hop)
