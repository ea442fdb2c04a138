"""The fleet's sampling secret: the key of every hash that picks a request's side of a
canary split, whether it is ordered a shadow run, and where that shadow runs.

Those decisions hash the request's session or request id, which its producer chooses.
Unkeyed, anyone could compute them offline and pick ids that land on the canary (to
reach a release the operator meant to try on a small share), that stay off it, that are
always or never shadowed (a shadow is one more GPU run; its comparison is what judges
a canary), or that send their shadows to one chosen worker. Keyed BLAKE2b
(``hashlib.blake2b(data, key=secret, digest_size=8)``) under a secret the producer does
not hold makes each id's outcome a coin it cannot see: choosing ids gains nothing over
sending them at random.

The decisions must agree wherever they are made — every admission replica, a
redelivered record, the worker that sends a shadow — so the secret is one for the
whole fleet: 32 to 64 random bytes, hex, in a file (``SEAWALL_SAMPLING_SECRET_FILE``;
``seawall up`` makes one in its state directory). A service that samples (admission, the
workers) does not start without it (``SamplingSecretMissing``): a random secret per
process would be as unpredictable, but two replicas would then split one session
between the canary and the baseline, and a record redelivered to another replica could
change sides; an unkeyed hash would quietly bring the attack back.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Final

from services.common.secret_files import make_hex_secret
from services.common.settings import CommonSettings

MIN_BYTES: Final = 32
MAX_BYTES: Final = 64
"""BLAKE2b takes a key of at most 64 bytes."""


class SamplingSecretMissing(RuntimeError):
    """A service that samples was started without the fleet's sampling secret."""


def keyed_hash(secret: bytes, data: str) -> int:
    """``data``'s 64-bit keyed BLAKE2b under ``secret``: the same on every replica and in
    every process that holds the secret, unpredictable to anyone who does not."""
    return int.from_bytes(hashlib.blake2b(data.encode(), key=secret, digest_size=8).digest())


def keyed_point(secret: bytes, data: str) -> float:
    """``data``'s place in [0, 1) (``keyed_hash`` scaled): a share ``p`` of all ids
    falls below ``p``."""
    return keyed_hash(secret, data) / 2**64


def parse_secret(text: str, source: str = "the sampling secret") -> bytes:
    """The secret written as hex (surrounding whitespace ignored)."""
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{source}: not hex") from None
    if not MIN_BYTES <= len(secret) <= MAX_BYTES:
        raise ValueError(
            f"{source}: {len(secret)} bytes; it must be {MIN_BYTES} to {MAX_BYTES} "
            "(openssl rand -hex 32)"
        )
    return secret


def load_secret(path: Path) -> bytes:
    try:
        text = path.read_text()
    except OSError as e:
        raise SamplingSecretMissing(f"cannot read the sampling secret {path}: {e}") from e
    return parse_secret(text, str(path))


def sampling_secret(settings: CommonSettings) -> bytes:
    """The fleet's sampling secret, for a service that samples; ``SamplingSecretMissing``
    where none is configured (see the module docstring for why there is no fallback)."""
    path = settings.sampling_secret_file
    if path is None:
        raise SamplingSecretMissing(
            "canary and shadow sampling must be keyed: set SEAWALL_SAMPLING_SECRET_FILE to "
            "a file holding the fleet's secret in hex (openssl rand -hex 32), the same "
            "file for every admission replica and every worker"
        )
    return load_secret(path)


def make_secret(path: Path) -> bool:
    """A new random secret at ``path`` (owner-only from its first byte), unless there is
    one already; whether one was made."""
    return make_hex_secret(path, MIN_BYTES)
