"""``seawall kafka-secrets``: a SCRAM credential the broker can hold without the password
and a client with the password still logs in against; a certificate clients verify by
the broker's names; files that stay put and stay private."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import re
import ssl
import stat
from pathlib import Path

import pytest
from scramp import ScramClient, ScramException, ScramMechanism

from seawall.kafka_acl import PRINCIPALS
from seawall.kafka_secrets import (
    SCRAM_ITERATIONS,
    password_file,
    salted_password,
    scram_argument,
    write_kafka_secrets,
)

pytestmark = pytest.mark.unit

ARGUMENT = re.compile(
    r"SCRAM-SHA-512=\[name=(?P<name>[^,]+),iterations=(?P<i>\d+),"
    r'salt="(?P<salt>[A-Za-z0-9+/=]+)",saltedpassword="(?P<salted>[A-Za-z0-9+/=]+)"\]'
)


def test_a_client_with_the_password_logs_in_against_the_salted_credential_alone() -> None:
    """What ``--add-scram`` gives the broker (salt, iterations, salted password) is
    all a SCRAM server needs (RFC 5802: StoredKey and ServerKey derive from it); a
    client knowing the password completes the exchange, one with another fails."""
    found = ARGUMENT.fullmatch(scram_argument("seawall-ingress", "s3cret"))
    assert found is not None
    assert found["name"] == "seawall-ingress"
    assert int(found["i"]) == SCRAM_ITERATIONS
    salt, salted = base64.b64decode(found["salt"]), base64.b64decode(found["salted"])
    client_key = hmac.digest(salted, b"Client Key", "sha512")
    info = (
        salt,
        hashlib.sha512(client_key).digest(),
        hmac.digest(salted, b"Server Key", "sha512"),
        SCRAM_ITERATIONS,
    )

    def exchange(password: str) -> bool:
        server = ScramMechanism("SCRAM-SHA-512").make_server(lambda _: info)
        client = ScramClient(["SCRAM-SHA-512"], "seawall-ingress", password)
        server.set_client_first(client.get_client_first())
        client.set_server_first(server.get_server_first())
        try:
            server.set_client_final(client.get_client_final())
        except ScramException:  # the client.s proof did not match
            return False
        client.set_server_final(server.get_server_final())  # the server proved itself too
        return True

    assert exchange("s3cret")
    assert not exchange("guess")


def test_the_salted_password_is_rfc_5802s_hi() -> None:
    """Checked against scramp's own derivation for the same salt."""
    salt = b"0123456789abcdef"
    _, stored, server_key, _ = ScramMechanism("SCRAM-SHA-512").make_auth_info(
        "pw", iteration_count=SCRAM_ITERATIONS, salt=salt
    )
    salted = salted_password("pw", salt)
    assert hmac.digest(salted, b"Server Key", "sha512") == server_key
    assert hashlib.sha512(hmac.digest(salted, b"Client Key", "sha512")).digest() == stored


@pytest.fixture
def secrets_dir(tmp_path: Path) -> Path:
    write_kafka_secrets(tmp_path / "kafka", prefix="acme.")
    return tmp_path / "kafka"


async def handshake(directory: Path, name: str) -> None:
    """A TLS handshake with the broker's key and certificate, the client trusting the
    CA alone and checking ``name`` as Kafka's clients do (``ssl.endpoint.
    identification.algorithm=https``)."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(directory / "broker.pem")  # key and certificate, one file
    client_ctx = ssl.create_default_context(cafile=directory / "ca.pem")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_ctx, server_hostname=name
        )
        writer.close()
    finally:
        server.close()


@pytest.mark.parametrize("name", ["kafka", "localhost", "127.0.0.1"])
async def test_clients_trusting_the_ca_verify_the_broker_by_its_names(
    secrets_dir: Path, name: str
) -> None:
    await handshake(secrets_dir, name)


async def test_a_name_the_certificate_does_not_carry_is_refused(secrets_dir: Path) -> None:
    with pytest.raises(ssl.SSLCertVerificationError):
        await handshake(secrets_dir, "kafka.example.com")


def test_every_file_is_private_and_secrets_survive_a_second_run(secrets_dir: Path) -> None:
    names = {p.name for p in secrets_dir.iterdir()}
    assert {f"{p}.password" for p in (*PRINCIPALS, "admin")} <= names
    assert {"ca.pem", "ca.key", "broker.pem", "server.properties", "admin.properties"} <= names
    assert {"start-kafka.sh", "acls.sh"} <= names
    for path in secrets_dir.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
    before = {p.name: p.read_bytes() for p in secrets_dir.iterdir()}
    write_kafka_secrets(secrets_dir, prefix="acme.")
    after = {p.name: p.read_bytes() for p in secrets_dir.iterdir()}
    for kept in ("ca.pem", "ca.key", "broker.pem", *(f"{p}.password" for p in PRINCIPALS)):
        assert after[kept] == before[kept], kept
    # The start script's salts are new; the credentials it adds are for the same
    # passwords: each still verifies.
    for line in ARGUMENT.finditer(after["start-kafka.sh"].decode()):
        password = password_file(secrets_dir, line["name"]).read_text().strip()
        salt = base64.b64decode(line["salt"])
        assert base64.b64decode(line["salted"]) == salted_password(password, salt)


def test_the_broker_and_the_admin_tools_log_in_as_admin(secrets_dir: Path) -> None:
    admin = password_file(secrets_dir, "admin").read_text().strip()
    server = (secrets_dir / "server.properties").read_text()
    assert f'username="admin" password="{admin}" user_admin="{admin}";' in server
    assert f'username="admin" password="{admin}";' in server
    tools = (secrets_dir / "admin.properties").read_text()
    assert "security.protocol=SASL_SSL" in tools
    assert f'password="{admin}"' in tools
    # Every principal gets a credential; no password appears in the start script.
    script = (secrets_dir / "start-kafka.sh").read_text()
    for principal in (*PRINCIPALS, "admin"):
        assert f"name={principal}," in script
        assert password_file(secrets_dir, principal).read_text().strip() not in script
    assert "acme.llm.ingress" in (secrets_dir / "acls.sh").read_text()  # the prefix
