"""Controller settings from the environment, scaled into the policies."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.controller.settings import ControllerSettings

pytestmark = pytest.mark.unit


def test_environment_scales_the_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEAWALL_TOPIC_PREFIX", "t1.")
    monkeypatch.setenv("SEAWALL_CONTROLLER_TIME_SCALE", "0.1")
    monkeypatch.setenv("SEAWALL_CONTROLLER_BATCH_SLA_MS", "250")
    monkeypatch.setenv("SEAWALL_CONTROLLER_SMALL_POOL", "tiny")
    settings = ControllerSettings()
    config = settings.decider_config()
    assert settings.app_id == "t1.seawall-controller"  # stacks sharing a broker never meet
    assert config.breaker.latency_p99_ms.recover_hold_s == pytest.approx(30.0)
    assert config.batch.sla_ms == 250.0
    assert config.small_pool == "tiny"


def test_decisions_must_not_expire_between_republications() -> None:
    with pytest.raises(ValidationError, match="re-publications"):
        ControllerSettings(controller_republish_s=60.0, controller_valid_for_s=30.0)


@pytest.mark.parametrize(
    ("row", "setting", "design", "changed"),
    [
        ("latency_p99_ms", "latency_{}_ms", (2000.0, 800.0), (3000.0, 1500.0)),
        ("error_rate", "error_rate_{}", (0.30, 0.05), (0.5, 0.1)),
    ],
)
def test_a_breaker_rows_thresholds_are_the_operators(
    monkeypatch: pytest.MonkeyPatch,
    row: str,
    setting: str,
    design: tuple[float, float],
    changed: tuple[float, float],
) -> None:
    trip, recover = (f"controller_{setting.format(end)}" for end in ("trip", "recover"))
    defaults = getattr(ControllerSettings().decider_config().breaker, row)
    assert (defaults.trip_above, defaults.recover_below) == design  # DESIGN's
    monkeypatch.setenv(f"SEAWALL_{trip.upper()}", str(changed[0]))
    monkeypatch.setenv(f"SEAWALL_{recover.upper()}", str(changed[1]))
    monkeypatch.setenv("SEAWALL_CONTROLLER_TIME_SCALE", "0.5")
    config = ControllerSettings().decider_config()
    got = getattr(config.breaker, row)
    assert (got.trip_above, got.recover_below) == changed
    assert got.recover_hold_s == pytest.approx(defaults.recover_hold_s * 0.5)
    assert got.min_samples == defaults.min_samples
    # The ladder's error rung is its own (DESIGN: 15 %), whatever the breaker's rows.
    assert config.degradation.error_rate.trip_above == 0.15
    with pytest.raises(ValidationError, match="hysteresis"):
        ControllerSettings(**{trip: changed[1], recover: changed[0]})


def test_smtp_credentials_without_starttls_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="STARTTLS=true"):
        ControllerSettings(
            alert_smtp_host="mail",
            alert_email_to="ops@example.org",
            alert_smtp_user="seawall",
            alert_smtp_password="secret",
        )


def test_a_webhook_url_is_a_secret_checked_without_being_echoed() -> None:
    token = "T0ken-in-the-path-9f8e"
    s = ControllerSettings(alert_webhook_url=f"https://hooks.example.org/services/{token}")
    assert s.alert_webhook_url is not None
    assert s.alert_webhook_url.get_secret_value().endswith(token)
    assert token not in repr(s) + str(s) + s.model_dump_json()
    with pytest.raises(ValidationError, match="http\\(s\\) URL with a host") as refused:
        ControllerSettings(alert_webhook_url=f"hooks.example.org/services/{token}")
    assert token not in str(refused.value)
