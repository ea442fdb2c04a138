"""Throwaway certificates for the TLS tests: a CA, a server certificate it signs for
``127.0.0.1`` (an IP address in its subjectAltName, and nothing else, so that a client
connecting by another name fails the hostname check), a client certificate it signs,
and a second CA that signed none of them (a client trusting only that one must refuse
the server). Made with ``cryptography`` in a directory of the test's own; nothing is
written anywhere else."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

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


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate,
    common_name: str,
    usage: x509.ObjectIdentifier,
    ip: str | None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if ip is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False,
        )
    return key, builder.sign(ca_key, hashes.SHA256())


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return path


def make_pki(folder: Path) -> Pki:
    """Make the certificates in ``folder`` (which must exist)."""
    ca_key, ca = _ca("seawall test CA")
    server_key, server = _leaf(ca_key, ca, SERVER_IP, ExtendedKeyUsageOID.SERVER_AUTH, SERVER_IP)
    client_key, client = _leaf(
        ca_key, ca, "seawall test client", ExtendedKeyUsageOID.CLIENT_AUTH, None
    )
    _, other = _ca("another CA")
    return Pki(
        ca=_write_cert(folder / "ca.pem", ca),
        server_cert=_write_cert(folder / "server.pem", server),
        server_key=_write_key(folder / "server.key", server_key),
        client_cert=_write_cert(folder / "client.pem", client),
        client_key=_write_key(folder / "client.key", client_key),
        other_ca=_write_cert(folder / "other-ca.pem", other),
    )
