"""``KafkaConfig``'s TLS and SASL settings: what it refuses, what it reads from the
environment, what aiokafka is handed (``connection_options``), and that the secrets
stay out of its ``repr``."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest

from seawall_client.kafka import (
    KafkaConfig,
    StaticTokenProvider,
    connection_options,
    new_admin,
    new_consumer,
    new_producer,
)
from tests.pki import Pki, make_pki

PASSWORD = "pa55-Wörd with spaces "
TOKEN = "eyJhbGciOiJub25lIn0.e30."
SASL_KEYS = {"sasl_mechanism", "sasl_plain_username", "sasl_plain_password"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def scram(**fields: Any) -> KafkaConfig:
    return KafkaConfig(
        security_protocol="SASL_PLAINTEXT",
        sasl_username="svc-seawall",
        sasl_password=PASSWORD,
        **fields,
    )


def test_plaintext_by_default_with_no_tls_and_no_sasl() -> None:
    options = connection_options(KafkaConfig(bootstrap="k:9092", instance_id="a"))
    assert options == {
        "bootstrap_servers": "k:9092",
        "client_id": "seawall-a",
        "security_protocol": "PLAINTEXT",
    }


def test_ssl_verifies_the_broker_against_the_ca_and_checks_its_name(pki: Pki) -> None:
    options = connection_options(KafkaConfig(security_protocol="SSL", ssl_cafile=str(pki.ca)))
    assert options["security_protocol"] == "SSL"
    assert SASL_KEYS.isdisjoint(options)
    context = options["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname is True
    subjects = [str(c["subject"]) for c in context.get_ca_certs()]
    assert len(subjects) == 1
    assert "seawall test CA" in subjects[0]


def test_ssl_without_a_ca_file_trusts_the_system_store() -> None:
    context = connection_options(KafkaConfig(security_protocol="SSL"))["ssl_context"]
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname is True


def test_a_client_certificate_is_loaded_with_its_key(pki: Pki, tmp_path: Path) -> None:
    config = KafkaConfig(
        security_protocol="SSL",
        ssl_cafile=str(pki.ca),
        ssl_certfile=str(pki.client_cert),
        ssl_keyfile=str(pki.client_key),
    )
    assert isinstance(connection_options(config)["ssl_context"], ssl.SSLContext)
    # The server's key does not belong to the client's certificate: OpenSSL says so.
    mismatched = KafkaConfig(
        security_protocol="SSL", ssl_certfile=str(pki.client_cert), ssl_keyfile=str(pki.server_key)
    )
    with pytest.raises(ssl.SSLError):
        connection_options(mismatched)
    with pytest.raises(FileNotFoundError):
        connection_options(KafkaConfig(security_protocol="SSL", ssl_cafile=str(tmp_path / "no")))


def test_sasl_plaintext_sends_the_login_without_tls() -> None:
    options = connection_options(scram(sasl_mechanism="SCRAM-SHA-256"))
    assert options["security_protocol"] == "SASL_PLAINTEXT"
    assert options["sasl_mechanism"] == "SCRAM-SHA-256"
    assert options["sasl_plain_username"] == "svc-seawall"
    assert options["sasl_plain_password"] == PASSWORD
    assert "ssl_context" not in options


def test_sasl_ssl_sends_the_login_over_a_verifying_tls_context(pki: Pki) -> None:
    options = connection_options(
        KafkaConfig(
            security_protocol="SASL_SSL",
            sasl_mechanism="PLAIN",
            sasl_username="u",
            sasl_password="p",
            ssl_cafile=str(pki.ca),
        )
    )
    assert options["security_protocol"] == "SASL_SSL"
    assert options["sasl_mechanism"] == "PLAIN"
    assert (options["sasl_plain_username"], options["sasl_plain_password"]) == ("u", "p")
    assert options["ssl_context"].check_hostname is True


async def test_oauthbearer_sends_the_static_token() -> None:
    config = KafkaConfig(
        security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER", sasl_oauth_token=TOKEN
    )
    options = connection_options(config)
    assert options["sasl_mechanism"] == "OAUTHBEARER"
    provider = options["sasl_oauth_token_provider"]
    assert isinstance(provider, StaticTokenProvider)
    assert await provider.token() == TOKEN
    assert TOKEN not in repr(provider)
    assert "sasl_plain_username" not in options


def test_the_secrets_stay_out_of_the_repr() -> None:
    for config in (
        scram(),
        KafkaConfig(
            security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER", sasl_oauth_token=TOKEN
        ),
    ):
        shown = f"{config!r} {config}"
        assert PASSWORD.strip() not in shown
        assert TOKEN not in shown
    assert "svc-seawall" in repr(scram())  # the user name is no secret


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"security_protocol": "SASL_SSL"}, "needs sasl_username and sasl_password"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_username": "u"}, "needs sasl_username"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_password": "p"}, "needs sasl_username"),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"},
            "needs sasl_oauth_token",
        ),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "OAUTHBEARER",
                "sasl_oauth_token": TOKEN,
                "sasl_username": "u",
            },
            "not a username",
        ),
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_username": "u",
                "sasl_password": "p",
                "sasl_oauth_token": TOKEN,
            },
            "is for OAUTHBEARER",
        ),
        ({"sasl_username": "u", "sasl_password": "p"}, "PLAINTEXT sends no credentials"),
        ({"security_protocol": "SSL", "sasl_password": "p"}, "SSL sends no credentials"),
        ({"ssl_cafile": "/ca.pem"}, "PLAINTEXT uses no TLS"),
        (
            {
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_username": "u",
                "sasl_password": "p",
                "ssl_cafile": "/ca.pem",
            },
            "SASL_PLAINTEXT uses no TLS",
        ),
        ({"security_protocol": "SSL", "ssl_keyfile": "/k.pem"}, "needs ssl_certfile"),
        ({"security_protocol": "TLS"}, "security_protocol must be one of"),
        ({"sasl_mechanism": "GSSAPI"}, "sasl_mechanism must be one of"),
    ],
)
def test_contradictory_settings_are_refused(fields: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        KafkaConfig(**fields)


def test_from_env_reads_the_security_settings(pki: Pki) -> None:
    config = KafkaConfig.from_env(
        {
            "SEAWALL_KAFKA_BOOTSTRAP": "kafka-1:9093,kafka-2:9093",
            "SEAWALL_KAFKA_SECURITY_PROTOCOL": " sasl_ssl ",
            "SEAWALL_KAFKA_SASL_MECHANISM": "scram-sha-256",
            "SEAWALL_KAFKA_SASL_USERNAME": "svc-seawall",
            "SEAWALL_KAFKA_SASL_PASSWORD": PASSWORD,
            "SEAWALL_KAFKA_SSL_CAFILE": str(pki.ca),
            "SEAWALL_KAFKA_SSL_CERTFILE": str(pki.client_cert),
            "SEAWALL_KAFKA_SSL_KEYFILE": str(pki.client_key),
        }
    )
    assert config.security_protocol == "SASL_SSL"
    assert config.sasl_mechanism == "SCRAM-SHA-256"
    assert (config.sasl_username, config.sasl_password) == ("svc-seawall", PASSWORD)
    assert (config.ssl_cafile, config.ssl_certfile, config.ssl_keyfile) == (
        str(pki.ca),
        str(pki.client_cert),
        str(pki.client_key),
    )
    options = connection_options(config)
    assert options["bootstrap_servers"] == "kafka-1:9093,kafka-2:9093"
    assert options["sasl_plain_password"] == PASSWORD


def test_from_env_takes_blank_as_unset_and_reads_the_oauth_token() -> None:
    assert KafkaConfig.from_env(
        {
            "SEAWALL_KAFKA_SECURITY_PROTOCOL": "",
            "SEAWALL_KAFKA_SASL_MECHANISM": " ",
            "SEAWALL_KAFKA_SASL_USERNAME": "",
            "SEAWALL_KAFKA_SSL_CAFILE": "  ",
        }
    ) == KafkaConfig.from_env({})
    config = KafkaConfig.from_env(
        {
            "SEAWALL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "SEAWALL_KAFKA_SASL_MECHANISM": "OAUTHBEARER",
            "SEAWALL_KAFKA_SASL_OAUTH_TOKEN": TOKEN,
        }
    )
    assert config.sasl_oauth_token == TOKEN
    with pytest.raises(ValueError, match="needs sasl_username and sasl_password"):
        KafkaConfig.from_env({"SEAWALL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"})


async def test_every_client_factory_is_given_the_same_security(pki: Pki) -> None:
    """The producer, the consumer and the admin client are all built from
    ``connection_options``: each holds the SASL login and a verifying TLS context.
    Read from the clients themselves, none of which is started."""
    config = KafkaConfig(
        bootstrap="127.0.0.1:1",
        security_protocol="SASL_SSL",
        sasl_username="svc-seawall",
        sasl_password=PASSWORD,
        ssl_cafile=str(pki.ca),
    )
    producer, consumer = new_producer(config), new_consumer(config, group_id=None)
    admin = new_admin(config)
    try:
        for client in (producer.client, consumer._client, admin._client):
            assert client._security_protocol == "SASL_SSL"
            assert client._sasl_mechanism == "SCRAM-SHA-512"
            assert client._sasl_plain_username == "svc-seawall"
            assert client._sasl_plain_password == PASSWORD
            assert client._ssl_context.check_hostname is True
    finally:
        await producer.stop()
        await consumer.stop()
        await admin.close()
