"""Ingress settings from the environment."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.ingress.settings import IngressSettings, safe_name

pytestmark = pytest.mark.unit


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEAWALL_INGRESS_PORT", "9000")
    monkeypatch.setenv("SEAWALL_USER_AGENT_BLACKLIST", "curl, badbot ,")
    monkeypatch.setenv("SEAWALL_REGION_TABLE", '{"10.0.0.0/8": "office"}')
    monkeypatch.setenv("SEAWALL_MODELS", '{"llama": "main", "tiny": "small"}')
    monkeypatch.setenv("SEAWALL_KEY_PEPPER", "s3cret-pepper-0123")
    s = IngressSettings()
    assert (s.ingress_host, s.ingress_port) == ("127.0.0.1", 9000)
    assert s.user_agent_blacklist == ("curl", "badbot")
    assert s.region_table == {"10.0.0.0/8": "office"}
    assert list(s.models) == ["llama", "tiny"]
    assert s.pepper == b"s3cret-pepper-0123"
    assert not s.dev_pepper
    assert "s3cret-pepper-0123" not in repr(s)


def test_defaults_in_development_mode() -> None:
    s = IngressSettings(dev_mode=True)
    assert s.max_request_bytes == 16 * 1024
    assert s.default_deadline_s == 120
    assert s.dev_pepper


def test_no_pepper_outside_development_mode_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SEAWALL_KEY_PEPPER", raising=False)
    with pytest.raises(ValidationError, match="SEAWALL_KEY_PEPPER"):
        IngressSettings()
    with pytest.raises(ValidationError, match="shorter than 16"):
        IngressSettings(key_pepper="short")


def test_the_pepper_may_come_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "pepper"
    path.write_text("from-a-file-0123456789\n")
    s = IngressSettings(key_pepper_file=path)
    assert (s.pepper, s.dev_pepper) == (b"from-a-file-0123456789", False)
    with pytest.raises(ValidationError, match="cannot read"):
        IngressSettings(key_pepper_file=tmp_path / "missing")


@pytest.mark.parametrize(
    "changes",
    [
        {"region_table": {"not-a-cidr": "x"}},
        {"models": {}},
        {"models": {"has space": "main"}},
        {"max_output_tokens": 40_000},
    ],
)
def test_bad_settings_fail_at_start(changes: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        IngressSettings(**changes)  # type: ignore[arg-type]


def test_trusted_proxies_are_cidrs_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEAWALL_TRUSTED_PROXIES", "10.0.0.0/8, 127.0.0.1/32,fd00::/8")
    s = IngressSettings(dev_mode=True)
    assert s.trusted_proxies == ("10.0.0.0/8", "127.0.0.1/32", "fd00::/8")
    assert [str(n) for n in s.proxies.networks] == ["10.0.0.0/8", "127.0.0.1/32", "fd00::/8"]
    assert ipaddress.ip_address("10.9.9.9") in s.proxies
    assert ipaddress.ip_address("127.0.0.2") not in s.proxies
    monkeypatch.setenv("SEAWALL_TRUSTED_PROXIES", "")
    assert not IngressSettings(dev_mode=True).proxies  # empty: no proxy is trusted
    monkeypatch.delenv("SEAWALL_TRUSTED_PROXIES")
    assert not IngressSettings(dev_mode=True).proxies  # the default


@pytest.mark.parametrize("old", ["0", "1", " 2 ", "10.0.0.0/8,1"])
def test_a_count_of_proxies_is_refused_with_what_to_set(
    monkeypatch: pytest.MonkeyPatch, old: str
) -> None:
    """The old form is refused, never reinterpreted as a network or as "trust none"."""
    monkeypatch.setenv("SEAWALL_TRUSTED_PROXIES", old)
    with pytest.raises(ValidationError, match=r"as CIDRs \(e\.g\. 10\.0\.0\.0/8"):
        IngressSettings(dev_mode=True)


@pytest.mark.parametrize("old", [0, 1])
def test_a_count_of_proxies_is_refused_in_code_too(old: int) -> None:
    with pytest.raises(ValidationError, match="no longer a count"):
        IngressSettings(dev_mode=True, trusted_proxies=old)


def test_a_bad_proxy_cidr_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEAWALL_TRUSTED_PROXIES", "10.0.0.0/8,10.0.0.0/33")
    with pytest.raises(ValidationError, match=r"10\.0\.0\.0/33"):
        IngressSettings(dev_mode=True)


def test_abort_budget_defaults() -> None:
    s = IngressSettings(dev_mode=True)
    assert (s.kafka_aborts_per_key_per_s, s.kafka_aborts_per_key_burst) == (20.0, 200)


def test_safe_name() -> None:
    assert safe_name("host-1.example:1234") == "host-1.example_1234"
    assert safe_name("") == "_"


def test_reply_topics_idle_time_must_outlast_three_heartbeats() -> None:
    s = IngressSettings(dev_mode=True)
    assert (s.reply_heartbeat_s, s.reply_idle_s, s.reply_sweep_s) == (300, 3 * 3600, 300)
    assert s.reply_sweep_max_deletions == 100
    IngressSettings(dev_mode=True, reply_heartbeat_s=60, reply_idle_s=180)
    with pytest.raises(ValidationError, match="three reply_heartbeat_s"):
        IngressSettings(dev_mode=True, reply_heartbeat_s=60, reply_idle_s=179)
