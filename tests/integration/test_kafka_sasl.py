"""SASL logins on the wire: every Kafka client seawall has — services and CLI
(``KafkaConfig``), the SDK, the controller's faust app, and a ``confluent-kafka``
producer configured as the README says — logs in with the credentials its settings
give, and a client without them, or with a wrong password, gets nowhere.

No broker that can run here logs a SCRAM user in (the embedded Tansu keeps none:
``test_kafka_security``), so these tests put ``tests.sasl_proxy.SaslFront`` in front
of a real Tansu: Kafka's SASL exchange with ``scramp``'s SCRAM server and PLAIN, then the
client's own bytes to the broker; for SASL_SSL, the TLS terminator of the TLS tests in
front of that. What is tested is the client side, as in the TLS tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError

from seawall import embedded
from seawall_client import SeawallClient
from seawall_client.kafka import (
    KafkaConfig,
    ensure_topics,
    new_admin,
    new_producer,
)
from seawall_client.topics import TopicSpec
from services.controller.faust_app import build_app
from services.controller.settings import ControllerSettings
from tests.integration.test_kafka_security import (
    API_KEY,
    TlsTerminator,
    refused_start,
    server_context,
    tansu,
)
from tests.pki import Pki, make_pki
from tests.relays import read_one, write_one
from tests.sasl_proxy import SaslFront

pytestmark = pytest.mark.integration

USERS = {"svc-ingress": "ingress-secret", "producer-acme": "acme-secret"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@contextlib.asynccontextmanager
async def sasl_broker(work: Path, pki: Pki | None = None) -> AsyncIterator[tuple[int, SaslFront]]:
    """A real embedded broker that only logged-in clients reach (the port they connect
    to, and the front that logs them in); with ``pki``, through TLS as well."""
    port = embedded.free_port()
    front_port = embedded.free_port() if pki is not None else port
    with tansu(work, advertised_port=port) as upstream:
        async with SaslFront(front_port, upstream, dict(USERS)) as front:
            if pki is None:
                yield port, front
            else:
                async with TlsTerminator(port, front_port, server_context(pki)):
                    yield port, front


def sasl_env(port: int, user: str, mechanism: str = "SCRAM-SHA-512") -> dict[str, str]:
    return {
        "SEAWALL_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}",
        "SEAWALL_KAFKA_IDEMPOTENCE": "false",  # the embedded broker has no producer ids
        "SEAWALL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "SEAWALL_KAFKA_SASL_MECHANISM": mechanism,
        "SEAWALL_KAFKA_SASL_USERNAME": user,
        "SEAWALL_KAFKA_SASL_PASSWORD": USERS.get(user, "not-the-password"),
    }


async def test_scram_credentials_from_env_carry_a_record(tmp_path: Path) -> None:
    async with sasl_broker(tmp_path) as (port, front):
        config = KafkaConfig.from_env(sasl_env(port, "svc-ingress"))
        topic = f"sasl-{uuid.uuid4().hex[:8]}"
        assert await ensure_topics(config, [TopicSpec(topic, 1)]) == [topic]
        await write_one(config, topic, b"logged in", b"k")
        record = await read_one(config, topic)
        assert (record.key, record.value) == (b"k", b"logged in")
    # The admin, the producer and the consumer each logged in, some more than once
    # (a connection per broker role).
    assert front.logins[("SCRAM-SHA-512", "svc-ingress")] >= 3
    assert not front.refusals


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "PLAIN"])
async def test_the_other_mechanisms_log_in_too(tmp_path: Path, mechanism: str) -> None:
    async with sasl_broker(tmp_path) as (port, front):
        admin = new_admin(KafkaConfig.from_env(sasl_env(port, "svc-ingress", mechanism)))
        try:
            await admin.start()
            assert isinstance(await admin.list_topics(), list)
        finally:
            await admin.close()
    assert front.logins[(mechanism, "svc-ingress")] >= 1


async def test_no_credentials_or_a_wrong_password_get_nowhere(tmp_path: Path) -> None:
    async with sasl_broker(tmp_path) as (port, front):
        await refused_start(KafkaConfig(bootstrap=f"127.0.0.1:{port}"))
        assert front.refusals["not_authenticated"] >= 1
        wrong = KafkaConfig.from_env(
            {**sasl_env(port, "svc-ingress"), "SEAWALL_KAFKA_SASL_PASSWORD": "guess"}
        )
        producer = new_producer(wrong, request_timeout_ms=5_000)
        try:
            with pytest.raises(KafkaError):
                await producer.start()
        finally:
            await producer.stop()
        assert front.refusals["SCRAM-SHA-512 failed"] >= 1
    assert not front.logins


async def test_the_readmes_confluent_kafka_producer_logs_in_over_sasl_ssl(
    tmp_path: Path, pki: Pki
) -> None:
    """README, "Kafka connections": the ``confluent-kafka`` producer exactly as shown
    there — SASL_SSL, SCRAM-SHA-512, the broker's name verified — but for the address,
    the password, the CA file and idempotence, which the embedded broker lacks."""
    confluent_kafka = pytest.importorskip("confluent_kafka")
    async with sasl_broker(tmp_path, pki) as (port, front):
        topic = f"readme-{uuid.uuid4().hex[:8]}"
        reader = KafkaConfig.from_env(
            {
                **sasl_env(port, "svc-ingress"),
                "SEAWALL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                "SEAWALL_KAFKA_SSL_CAFILE": str(pki.ca),
            }
        )
        await ensure_topics(reader, [TopicSpec(topic, 1)])
        password = USERS["producer-acme"]
        producer = confluent_kafka.Producer(
            {
                "bootstrap.servers": f"127.0.0.1:{port}",
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "SCRAM-SHA-512",
                "sasl.username": "producer-acme",
                "sasl.password": password,
                "ssl.ca.location": str(pki.ca),
                "ssl.endpoint.identification.algorithm": "https",  # verify the broker's name
                "acks": "all",
                "enable.idempotence": False,  # the README: True; the embedded broker: none
            }
        )
        delivered: list[object] = []
        producer.produce(
            topic, b"from confluent", b"k", on_delivery=lambda e, _: delivered.append(e)
        )
        assert await asyncio.to_thread(producer.flush, 30) == 0
        assert delivered == [None]  # no delivery error
        record = await read_one(reader, topic)
        assert (record.key, record.value) == (b"k", b"from confluent")
    assert front.logins[("SCRAM-SHA-512", "producer-acme")] >= 1


async def test_the_sdk_logs_in_with_the_settings_of_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with sasl_broker(tmp_path) as (port, front):
        for name, value in sasl_env(port, "producer-acme").items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("SEAWALL_TOPIC_PREFIX", f"t{uuid.uuid4().hex[:8]}.")
        client = SeawallClient(api_key=API_KEY)
        await client.start()
        try:
            assert client.running
        finally:
            await client.stop()
    assert front.logins[("SCRAM-SHA-512", "producer-acme")] >= 3  # admin, reader, producer


async def test_the_controllers_faust_producer_logs_in(tmp_path: Path) -> None:
    async with sasl_broker(tmp_path) as (port, front):
        settings = ControllerSettings(
            kafka_bootstrap=f"127.0.0.1:{port}",
            kafka_idempotence=False,
            kafka_security_protocol="SASL_PLAINTEXT",
            kafka_sasl_username="svc-ingress",
            kafka_sasl_password=USERS["svc-ingress"],
            topic_prefix=f"t{uuid.uuid4().hex[:8]}.",
        )
        topic = f"{settings.topic_prefix}faust"
        await ensure_topics(settings.kafka, [TopicSpec(topic, 1)])
        before = front.logins[("SCRAM-SHA-512", "svc-ingress")]
        app = build_app(settings, tmp_path / "faust")
        await app.producer.start()
        try:
            await app.producer.send_and_wait(topic, b"k", b"from faust", None, None, None)
        finally:
            await app.producer.stop()
        assert front.logins[("SCRAM-SHA-512", "svc-ingress")] > before  # faust's own login
        record = await read_one(settings.kafka, topic)
        assert (record.key, record.value) == (b"k", b"from faust")
