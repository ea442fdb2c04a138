"""The environment ``seawall up`` gives its services (no process started)."""

from __future__ import annotations

import io
import stat
from pathlib import Path

import pytest
from rich.console import Console

from seawall.embedded import FETCH_BUSY_WAIT_MS
from seawall.up import Stack, UpOptions
from services.common.sampling import load_secret
from services.common.settings import CommonSettings

BUSY = "SEAWALL_CONSUMER_FETCH_BUSY_WAIT_MS"


def _env(options: UpOptions) -> dict[str, str]:
    return Stack(options, Console(file=io.StringIO())).child_env("admission")


def test_on_the_embedded_broker_consumers_get_the_busy_fetch_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(BUSY, raising=False)
    env = _env(UpOptions(state_dir=tmp_path))
    assert env[BUSY] == str(FETCH_BUSY_WAIT_MS)
    settings = CommonSettings(_env_file=None, consumer_fetch_busy_wait_ms=env[BUSY])
    assert settings.kafka.fetch_busy_wait_ms == FETCH_BUSY_WAIT_MS


def test_the_environment_wins_over_the_embedded_busy_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BUSY, "25")
    assert _env(UpOptions(state_dir=tmp_path))[BUSY] == "25"


def test_an_external_broker_gets_no_busy_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(BUSY, raising=False)
    assert BUSY not in _env(UpOptions(kafka_bootstrap="kafka:9092", state_dir=tmp_path))


def test_a_busy_wait_above_the_fetch_wait_is_refused() -> None:
    with pytest.raises(ValueError, match="busy_wait"):
        CommonSettings(
            _env_file=None, consumer_fetch_max_wait_ms=20, consumer_fetch_busy_wait_ms=30
        )


def test_a_blank_busy_wait_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BUSY, "")
    assert CommonSettings(_env_file=None).consumer_fetch_busy_wait_ms is None


def test_every_service_gets_one_sampling_secret_made_owner_only_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission and the workers refuse to start without the fleet's sampling secret
    (services.common.sampling), and all of them must hold the same one."""
    monkeypatch.delenv("SEAWALL_SAMPLING_SECRET_FILE", raising=False)
    stack = Stack(UpOptions(state_dir=tmp_path), Console(file=io.StringIO()))
    stack._sampling_secret = stack._ensure_sampling_secret()
    paths = {stack.child_env(name)["SEAWALL_SAMPLING_SECRET_FILE"] for name in ("a", "w0", "w1")}
    (path,) = paths
    assert Path(path) == (tmp_path / "sampling_secret").resolve()
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    secret = load_secret(Path(path))
    # a restarted stack keeps it: the decisions of its services do not move
    again = Stack(UpOptions(state_dir=tmp_path), Console(file=io.StringIO()))
    assert again._ensure_sampling_secret() == Path(path)
    assert load_secret(Path(path)) == secret


def test_the_environment_s_own_sampling_secret_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SEAWALL_SAMPLING_SECRET_FILE", "/etc/seawall/sampling")
    stack = Stack(UpOptions(state_dir=tmp_path), Console(file=io.StringIO()))
    assert stack._ensure_sampling_secret() is None
    assert not (tmp_path / "sampling_secret").exists()
