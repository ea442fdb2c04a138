"""An Apache Kafka broker that only seawall's principals reach, over TLS, each with the
ACLs of its role (``seawall kafka-secrets DIR``; compose/ and the Kubernetes manifests
run Kafka from the files it writes).

What ``write_kafka_secrets`` leaves in ``DIR`` (made where missing, never over a secret
already there; every file owner-only):

- ``<principal>.password`` for each service, the operator's CLI and ``admin`` (the
  broker's own principal): 256 random bits each;
- ``ca.pem`` and ``ca.key``: a private CA (ECDSA P-256, ten years), and ``broker.pem``:
  the broker's key (PKCS#8) and certificate, signed by it for ``hosts``, two years — the
  layout of Kafka's PEM key store (KIP-651: ``ssl.keystore.type=PEM``). Clients verify
  the broker against ``ca.pem``, its name included;
- ``server.properties``: a one-node KRaft broker and controller with ``SASL_SSL``
  (SCRAM-SHA-512) on the listeners clients use, SASL PLAIN on the controller listener
  (SCRAM is not offered there: KIP-900), ``StandardAuthorizer`` with
  ``allow.everyone.if.no.acl.found=false`` and ``admin`` alone a super user; it holds
  the admin password;
- ``start-kafka.sh``: formats the storage with every principal's SCRAM credential
  (``kafka-storage.sh format --add-scram``, KIP-900: in the metadata log before the
  broker first listens, as a salted password, never the password itself) and starts
  the broker;
- ``admin.properties``: the admin tools' client settings (``--command-config``);
- ``acls.sh``: the ``kafka-acls.sh`` commands of ``seawall.kafka_acl.service_acls``,
  safe to rerun.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import secrets
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from seawall.kafka_acl import ADMIN, PRINCIPALS, kafka_acls_commands, service_acls
from seawall.pki import Key, new_ca, new_leaf, pem_cert, pem_key
from services.common.secret_files import hex_secret, write_private

SCRAM_ITERATIONS: Final = 8192
"""Above Kafka's floor of 4096 for SCRAM-SHA-512 (``ScramMechanism``)."""
SECRETS_MOUNT: Final = "/run/secrets"
"""Where the containers find these files (compose/ mounts each as ``kafka_<name>``)."""
INTERNAL_PORT: Final = 19092
HOST_PORT: Final = 9092
CONTROLLER_PORT: Final = 9093
DEFAULT_HOSTS: Final = ("kafka", "localhost", "127.0.0.1")


def password_file(directory: Path, principal: str) -> Path:
    return directory / f"{principal}.password"


def salted_password(password: str, salt: bytes, iterations: int = SCRAM_ITERATIONS) -> bytes:
    """RFC 5802's ``SaltedPassword := Hi(Normalize(password), salt, i)``: PBKDF2 with
    HMAC-SHA-512 (SASLprep is the identity on the hex passwords made here)."""
    return hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)


def scram_argument(principal: str, password: str, salt: bytes | None = None) -> str:
    """One ``--add-scram`` value of ``kafka-storage.sh format``, in the salted form its
    help shows (``SCRAM-SHA-512=[name=alice,iterations=8192,salt="N3E=",
    saltedpassword="YCE="]``, base64)."""
    salt = secrets.token_bytes(16) if salt is None else salt
    salted = salted_password(password, salt)
    return (
        f"SCRAM-SHA-512=[name={principal},iterations={SCRAM_ITERATIONS},"
        f'salt="{base64.b64encode(salt).decode()}",'
        f'saltedpassword="{base64.b64encode(salted).decode()}"]'
    )


_SCRAM_LOGIN: Final = "org.apache.kafka.common.security.scram.ScramLoginModule required"
_PLAIN_LOGIN: Final = "org.apache.kafka.common.security.plain.PlainLoginModule required"


def server_properties(admin_password: str, advertised_host: str = "kafka") -> str:
    mount, scram, plain = SECRETS_MOUNT, _SCRAM_LOGIN, _PLAIN_LOGIN
    lines = [
        "# Made by `seawall kafka-secrets` (seawall/kafka_secrets.py); holds the admin",
        "# password: keep it as secret as the passwords beside it.",
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.voters=1@localhost:{CONTROLLER_PORT}",
        # HOST: processes on the Docker host (127.0.0.1 only, compose/ binds it so);
        # INTERNAL: the containers and the broker itself; CONTROLLER: this process only.
        f"listeners=HOST://:{HOST_PORT},INTERNAL://:{INTERNAL_PORT},"
        f"CONTROLLER://localhost:{CONTROLLER_PORT}",
        f"advertised.listeners=HOST://127.0.0.1:{HOST_PORT},"
        f"INTERNAL://{advertised_host}:{INTERNAL_PORT}",
        "listener.security.protocol.map=HOST:SASL_SSL,INTERNAL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT",
        "inter.broker.listener.name=INTERNAL",
        "controller.listener.names=CONTROLLER",
        "sasl.enabled.mechanisms=SCRAM-SHA-512",
        "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512",
        "sasl.mechanism.controller.protocol=PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms=PLAIN",
        f"listener.name.controller.plain.sasl.jaas.config={plain} "
        f'username="{ADMIN}" password="{admin_password}" user_{ADMIN}="{admin_password}";',
        f"listener.name.internal.scram-sha-512.sasl.jaas.config={scram} "
        f'username="{ADMIN}" password="{admin_password}";',
        f"listener.name.host.scram-sha-512.sasl.jaas.config={scram};",
        "ssl.keystore.type=PEM",
        f"ssl.keystore.location={mount}/kafka_broker_pem",
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={mount}/kafka_ca",
        "ssl.endpoint.identification.algorithm=https",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found=false",
        f"super.users=User:{ADMIN}",
        "auto.create.topics.enable=false",
        "offsets.topic.replication.factor=1",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "log.dirs=/var/lib/kafka/data",
    ]
    return "\n".join(lines) + "\n"


def admin_properties(admin_password: str) -> str:
    return (
        "security.protocol=SASL_SSL\n"
        "sasl.mechanism=SCRAM-SHA-512\n"
        f'sasl.jaas.config={_SCRAM_LOGIN} username="{ADMIN}" password="{admin_password}";\n'
        "ssl.truststore.type=PEM\n"
        f"ssl.truststore.location={SECRETS_MOUNT}/kafka_ca\n"
    )


def start_script(scram_arguments: Sequence[str], cluster_id: str) -> str:
    """Format (once per empty data directory: ``--ignore-formatted``) and start."""
    bin_ = "/opt/kafka/bin"
    adds = " ".join(f"--add-scram {shlex.quote(a)}" for a in scram_arguments)
    return (
        "#!/bin/bash\n"
        "# Made by `seawall kafka-secrets`: the principals' SCRAM credentials go into the\n"
        "# metadata log before the broker first listens (KIP-900).\n"
        "set -euo pipefail\n"
        f"{bin_}/kafka-storage.sh format --ignore-formatted --cluster-id {cluster_id} \\\n"
        f"  --config {SECRETS_MOUNT}/kafka_server_properties {adds}\n"
        f"exec {bin_}/kafka-server-start.sh {SECRETS_MOUNT}/kafka_server_properties\n"
    )


def acls_script(prefix: str, bootstrap: str = f"kafka:{INTERNAL_PORT}") -> str:
    lines = kafka_acls_commands(
        service_acls(prefix),
        bootstrap,
        f"{SECRETS_MOUNT}/kafka_admin_properties",
        tool="/opt/kafka/bin/kafka-acls.sh",
    )
    return "#!/bin/bash\nset -euo pipefail\n" + "\n".join(lines) + "\n"


def write_kafka_secrets(
    directory: Path,
    prefix: str = "",
    hosts: Sequence[str] = DEFAULT_HOSTS,
    now: datetime.datetime | None = None,
) -> None:
    """Write what the module's docstring lists into ``directory``: passwords and the CA
    only where missing; the broker's certificate where missing; the configuration and
    scripts every time (they follow the passwords, the hosts and ``prefix``)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    passwords = {}
    for principal in (*PRINCIPALS, ADMIN):
        path = password_file(directory, principal)
        passwords[principal] = hex_secret(path)
    now = now or datetime.datetime.now(datetime.UTC)
    ca_key, ca_cert = _ensure_ca(directory, now)
    if not (directory / "broker.pem").exists():
        usages = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
        key, cert = new_leaf(ca_key, ca_cert, hosts[0], hosts, usages, now, days=730)
        write_private(directory / "broker.pem", pem_key(key) + pem_cert(cert))
    cluster_id = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
    scram = [scram_argument(p, passwords[p]) for p in (*PRINCIPALS, ADMIN)]
    for name, text in (
        ("server.properties", server_properties(passwords[ADMIN], hosts[0])),
        ("admin.properties", admin_properties(passwords[ADMIN])),
        ("start-kafka.sh", start_script(scram, cluster_id)),
        ("acls.sh", acls_script(prefix)),
    ):
        path = directory / name
        path.unlink(missing_ok=True)
        write_private(path, text)


def _ensure_ca(directory: Path, now: datetime.datetime) -> tuple[Key, x509.Certificate]:
    key_path, cert_path = directory / "ca.key", directory / "ca.pem"
    if key_path.exists() and cert_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return key, x509.load_pem_x509_certificate(cert_path.read_bytes())
    key, cert = new_ca("seawall Kafka CA", now, days=3650)
    key_path.unlink(missing_ok=True)
    cert_path.unlink(missing_ok=True)
    write_private(key_path, pem_key(key))
    write_private(cert_path, pem_cert(cert))
    return key, cert
