"""Secrets kept in files: written owner-only from their first byte, never over one that
is there already (the pepper, the sampling secret, the hop secrets, the control keys)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Create ``path`` holding ``text``, readable by its owner only; ``FileExistsError``
    if there is one already (a secret is never replaced by accident)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def make_hex_secret(path: Path, nbytes: int = 32) -> bool:
    """``nbytes`` random bytes, in hex, at ``path`` (its folder made if need be), unless a
    file is there already; whether one was made."""
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, secrets.token_hex(nbytes) + "\n")
    return True


def hex_secret(path: Path, nbytes: int = 32) -> str:
    """The hex secret at ``path`` (its first line), made (``make_hex_secret``) where
    there is none yet: the passwords a deployment's secrets are generated from."""
    make_hex_secret(path, nbytes)
    return path.read_text().splitlines()[0].strip()
