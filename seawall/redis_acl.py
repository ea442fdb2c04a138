"""Redis ACL users for a shared Redis (``seawall redis-acl``): what the services may do
there, and the passwords they log in with.

Three users, in a file for ``redis-server --aclfile``:

- ``default`` off: a client that does not log in can run nothing (Redis's own default
  user answers anyone who reaches the port);
- ``seawall``, the services' and the CLI's: every key and pub/sub channel under the
  deployment's ``redis_prefix`` and nothing else (``~<prefix>*``, ``&<prefix>*``), every
  command but the ``@admin`` and ``@dangerous`` ones (no ``CONFIG``, ``FLUSHALL``,
  ``KEYS``, ``DEBUG``, ``SHUTDOWN``, ``ACL``, ``MONITOR``, ``CLIENT KILL``, ...). A
  script (``EVALSHA``) is held to the same key patterns for every key it touches;
- ``admin``, the operator's, for maintenance (``redis-cli --user admin``): everything.

Passwords are 256 random bits each, written owner-only beside the file
(``seawall.password``, ``admin.password``), never over one already there; the ACL file
holds only their SHA-256 (``#<hex>``), so it reveals no password. The services read
theirs from ``SEAWALL_REDIS_PASSWORD_FILE`` with ``SEAWALL_REDIS_USERNAME=seawall``.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Final

from services.common.secret_files import hex_secret

ACL_FILE: Final = "users.acl"
SERVICE_USER: Final = "seawall"
ADMIN_USER: Final = "admin"
_PREFIX = re.compile(r"^[A-Za-z0-9:._-]{1,64}$")


def password_file(directory: Path, user: str) -> Path:
    return directory / f"{user}.password"


def acl_lines(prefix: str, passwords: dict[str, str]) -> list[str]:
    """The ACL file's lines for ``prefix`` (the services' ``redis_prefix``) and the
    ``seawall`` and ``admin`` users' passwords."""
    if not _PREFIX.match(prefix):
        raise ValueError(f"not a Redis key prefix seawall would use: {prefix!r}")

    def digest(user: str) -> str:
        return "#" + hashlib.sha256(passwords[user].encode()).hexdigest()

    return [
        "user default off resetkeys resetchannels -@all",
        f"user {SERVICE_USER} on {digest(SERVICE_USER)} resetkeys resetchannels "
        f"~{prefix}* &{prefix}* +@all -@admin -@dangerous",
        f"user {ADMIN_USER} on {digest(ADMIN_USER)} ~* &* +@all",
    ]


def write_acl(directory: Path, prefix: str) -> Path:
    """Make the passwords in ``directory`` where missing, and (re)write the ACL file for
    them and ``prefix``; the ACL file's path."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    passwords = {}
    for user in (SERVICE_USER, ADMIN_USER):
        path = password_file(directory, user)
        passwords[user] = hex_secret(path)
    acl = directory / ACL_FILE
    acl.write_text("\n".join(acl_lines(prefix, passwords)) + "\n")
    acl.chmod(0o600)
    return acl
