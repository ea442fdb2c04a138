"""The services read the Kafka security settings from the same ``SEAWALL_KAFKA_*``
variables as the client SDK, keep the password a ``SecretStr`` (never shown), and refuse
to start on settings that contradict each other."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from seawall_client.kafka import KafkaConfig, connection_options
from services.common.settings import CommonSettings

PASSWORD = "s3cret-pa55word"
TOKEN = "eyJhbGciOiJub25lIn0.e30."
ENV = {
    "SEAWALL_KAFKA_BOOTSTRAP": "kafka-1:9093",
    "SEAWALL_KAFKA_SECURITY_PROTOCOL": "sasl_plaintext",
    "SEAWALL_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
    "SEAWALL_KAFKA_SASL_USERNAME": "svc-seawall",
    "SEAWALL_KAFKA_SASL_PASSWORD": PASSWORD,
}


def test_the_services_read_the_names_the_sdk_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    settings = CommonSettings(instance_id="svc")
    assert settings.kafka == KafkaConfig.from_env({**ENV, "SEAWALL_INSTANCE_ID": "svc"})
    options = connection_options(settings.kafka)
    assert options["security_protocol"] == "SASL_PLAINTEXT"
    assert options["sasl_mechanism"] == "SCRAM-SHA-256"
    assert options["sasl_plain_password"] == PASSWORD


def test_the_password_and_token_are_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    settings = CommonSettings()
    shown = f"{settings!r} {settings} {settings.model_dump()} {settings.kafka!r}"
    assert PASSWORD not in shown
    assert "svc-seawall" in shown
    oauth = CommonSettings(
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="OAUTHBEARER",
        kafka_sasl_username=None,
        kafka_sasl_password=None,
        kafka_sasl_oauth_token=TOKEN,
    )
    assert TOKEN not in f"{oauth!r} {oauth.model_dump()} {oauth.kafka!r}"
    assert oauth.kafka.sasl_oauth_token == TOKEN


def test_contradictory_security_settings_stop_the_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SEAWALL_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    with pytest.raises(ValidationError, match="needs sasl_username and sasl_password"):
        CommonSettings()
    monkeypatch.setenv("SEAWALL_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT")
    monkeypatch.setenv("SEAWALL_KAFKA_SASL_USERNAME", "u")
    monkeypatch.setenv("SEAWALL_KAFKA_SASL_PASSWORD", "p")
    with pytest.raises(ValidationError, match="PLAINTEXT sends no credentials"):
        CommonSettings()
    monkeypatch.setenv("SEAWALL_KAFKA_SECURITY_PROTOCOL", "TLS")
    with pytest.raises(ValidationError, match="kafka_security_protocol"):
        CommonSettings()


def test_a_refused_setting_does_not_echo_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    """pydantic's message for a check of the whole model shows the inputs it was given
    (the Kafka password last among them, here); the settings hide them."""
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SEAWALL_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT")
    with pytest.raises(ValidationError) as refused:
        CommonSettings(kafka_sasl_password=PASSWORD)
    assert "sends no credentials" in str(refused.value)
    assert PASSWORD not in str(refused.value)
    assert PASSWORD not in repr(refused.value)


def test_blank_variables_are_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "SEAWALL_KAFKA_SASL_USERNAME",
        "SEAWALL_KAFKA_SASL_PASSWORD",
        "SEAWALL_KAFKA_SASL_OAUTH_TOKEN",
        "SEAWALL_KAFKA_SSL_CAFILE",
        "SEAWALL_KAFKA_SSL_CERTFILE",
        "SEAWALL_KAFKA_SSL_KEYFILE",
    ):
        monkeypatch.setenv(name, " ")
    assert CommonSettings(instance_id="x").kafka == KafkaConfig(instance_id="x")


def test_the_password_can_come_from_a_file_read_when_a_client_is_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """compose/ mounts each principal's password as a file (``seawall kafka-secrets``):
    its first line is the password, read at each client built, so a rotated file is
    taken without a restart; a file that is not there yet does not stop the settings
    from loading, and a password given twice is refused."""
    env = {k: v for k, v in ENV.items() if k != "SEAWALL_KAFKA_SASL_PASSWORD"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    secret = tmp_path / "kafka_password"
    monkeypatch.setenv("SEAWALL_KAFKA_SASL_PASSWORD_FILE", str(secret))
    settings = CommonSettings()  # the file is read later
    secret.write_text(f"{PASSWORD}\n")
    assert settings.kafka.sasl_password == PASSWORD
    assert connection_options(settings.kafka)["sasl_plain_password"] == PASSWORD
    secret.write_text("rotated\n")
    assert settings.kafka.sasl_password == "rotated"
    assert "rotated" not in f"{settings!r} {settings.model_dump()}"
    secret.write_text("\n")
    with pytest.raises(ValueError, match="no password in it"):
        settings.kafka  # noqa: B018
    monkeypatch.setenv("SEAWALL_KAFKA_SASL_PASSWORD", PASSWORD)
    with pytest.raises(ValidationError, match="give the password once"):
        CommonSettings()
    monkeypatch.delenv("SEAWALL_KAFKA_SASL_PASSWORD")
    monkeypatch.delenv("SEAWALL_KAFKA_SASL_PASSWORD_FILE")
    with pytest.raises(ValidationError, match="needs sasl_username and sasl_password"):
        CommonSettings()  # SASL with neither a password nor its file
