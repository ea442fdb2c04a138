"""Throwaway certificates for the TLS tests: a CA, a server certificate it signs for
``127.0.0.1`` (an IP address in its subjectAltName, and nothing else, so that a client
connecting by another name fails the hostname check), a client certificate it signs,
and a second CA that signed none of them (a client trusting only that one must refuse
the server). Made with ``seawall.pki`` in a directory of the test's own; nothing is
written anywhere else."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from seawall.pki import Key, new_ca, new_leaf, pem_cert, pem_key

SERVER_IP = "127.0.0.1"


@dataclass(frozen=True)
class Pki:
    ca: Path
    """The CA certificate (PEM) that signed the server's and the client's."""
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    """A CA that signed nothing here."""


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_text(pem_cert(cert))
    return path


def _write_key(path: Path, key: Key) -> Path:
    path.write_text(pem_key(key))
    path.chmod(0o600)
    return path


def make_pki(folder: Path) -> Pki:
    """Make the certificates in ``folder`` (which must exist)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, ca = new_ca("seawall test CA", now, days=1)
    server_key, server = new_leaf(
        ca_key, ca, SERVER_IP, [SERVER_IP], [ExtendedKeyUsageOID.SERVER_AUTH], now, days=1
    )
    client_key, client = new_leaf(
        ca_key, ca, "seawall test client", [], [ExtendedKeyUsageOID.CLIENT_AUTH], now, days=1
    )
    _, other = new_ca("another CA", now, days=1)
    return Pki(
        ca=_write_cert(folder / "ca.pem", ca),
        server_cert=_write_cert(folder / "server.pem", server),
        server_key=_write_key(folder / "server.key", server_key),
        client_cert=_write_cert(folder / "client.pem", client),
        client_key=_write_key(folder / "client.key", client_key),
        other_ca=_write_cert(folder / "other-ca.pem", other),
    )
