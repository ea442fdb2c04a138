"""The controller's faust app reaches the broker with the same TLS and SASL settings as
the process's other clients: what faust hands aiokafka from ``broker_credentials``
(through faust's own ``credentials_to_aiokafka_auth``) is what ``connection_options``
hands it."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import faust
import pytest
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from seawall_client.kafka import KafkaConfig, StaticTokenProvider, connection_options
from services.controller.faust_app import broker_credentials, build_app
from services.controller.settings import ControllerSettings
from tests.pki import Pki, make_pki

pytestmark = pytest.mark.unit

SECURITY_KEYS = (
    "security_protocol",
    "sasl_mechanism",
    "sasl_plain_username",
    "sasl_plain_password",
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def configs(ca: Path) -> list[KafkaConfig]:
    login: dict[str, Any] = {"sasl_username": "svc-seawall", "sasl_password": "pw"}
    return [
        KafkaConfig(security_protocol="SSL", ssl_cafile=str(ca)),
        KafkaConfig(security_protocol="SASL_PLAINTEXT", **login),
        KafkaConfig(security_protocol="SASL_SSL", ssl_cafile=str(ca), **login),
        KafkaConfig(
            security_protocol="SASL_SSL",
            sasl_mechanism="SCRAM-SHA-256",
            ssl_cafile=str(ca),
            **login,
        ),
        KafkaConfig(security_protocol="SASL_SSL", sasl_mechanism="PLAIN", **login),
    ]


def test_plaintext_gives_faust_no_credentials() -> None:
    assert broker_credentials(KafkaConfig()) is None
    assert credentials_to_aiokafka_auth(None) == {"security_protocol": "PLAINTEXT"}


def test_faust_hands_aiokafka_what_our_clients_get(pki: Pki) -> None:
    for config in configs(pki.ca):
        ours = connection_options(config)
        faust_s = credentials_to_aiokafka_auth(broker_credentials(config))
        assert {k: faust_s.get(k) for k in SECURITY_KEYS} == {
            k: ours.get(k) for k in SECURITY_KEYS
        }, config.security_protocol
        if "ssl_context" in ours:
            context = faust_s["ssl_context"]
            assert isinstance(context, ssl.SSLContext)
            assert context.verify_mode == ssl.CERT_REQUIRED
            assert context.check_hostname is True
        else:
            assert faust_s.get("ssl_context") is None


async def test_faust_takes_oauthbearer_with_the_static_token() -> None:
    config = KafkaConfig(
        security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER", sasl_oauth_token="tok"
    )
    auth = credentials_to_aiokafka_auth(broker_credentials(config))
    assert auth["security_protocol"] == "SASL_SSL"
    assert auth["sasl_mechanism"] == "OAUTHBEARER"
    assert isinstance(auth["sasl_oauth_token_provider"], StaticTokenProvider)
    assert await auth["sasl_oauth_token_provider"].token() == "tok"


def test_the_controllers_app_is_built_with_them(tmp_path: Path) -> None:
    settings = ControllerSettings(
        kafka_security_protocol="SASL_PLAINTEXT",
        kafka_sasl_username="svc-controller",
        kafka_sasl_password="pw",
    )
    app = build_app(settings, tmp_path)
    credentials = app.conf.broker_credentials
    assert isinstance(credentials, faust.SASLCredentials)
    assert credentials.mechanism.value == "SCRAM-SHA-512"
    assert (credentials.username, credentials.password) == ("svc-controller", "pw")
    assert "pw" not in repr(credentials)  # faust's repr names the user only
