"""seawall's Prometheus rules and Alertmanager configuration, checked by the real tools:
``promtool check rules`` and ``promtool test rules`` (the unit tests under
``deploy/prometheus/tests``), ``amtool check-config``, and where Alertmanager routes
alerts (``amtool config routes test``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.observability.conftest import DEPLOY, tool

RULES = DEPLOY / "prometheus" / "seawall.rules.yml"
ALERTMANAGER = DEPLOY / "alertmanager" / "alertmanager.yml"


def run(*args: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_rules_are_valid() -> None:
    out = run(tool("promtool"), "check", "rules", str(RULES))
    assert "SUCCESS: 17 rules found" in out


def test_the_rules_unit_tests_pass() -> None:
    tests = sorted((DEPLOY / "prometheus" / "tests").glob("*.yml"))
    assert tests
    out = run(tool("promtool"), "test", "rules", *map(str, tests))
    assert "SUCCESS" in out


def test_a_broken_rule_is_caught(tmp_path: Path) -> None:
    """The check is not a formality: a rule with bad PromQL fails it."""
    broken = tmp_path / "broken.yml"
    broken.write_text(RULES.read_text().replace("sum by (pool) (rate(", "sum by (pool) (rat(", 1))
    done = subprocess.run(
        [tool("promtool"), "check", "rules", str(broken)], capture_output=True, check=False
    )
    assert done.returncode != 0


def test_the_alertmanager_config_is_valid() -> None:
    out = run(tool("amtool"), "check-config", str(ALERTMANAGER))
    assert "SUCCESS" in out
    assert "2 inhibit rules" in out


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (
            ["severity=critical", "rule=breaker_open", "scope=pool:main", "pool=main"],
            "seawall-oncall",
        ),
        (["severity=warning", "rule=degradation", "scope=pool:main", "pool=main"], "seawall-ops"),
        (["severity=info", "rule=hotspot_throttle", "scope=hotspot:eu"], "seawall-ops"),
    ],
)
def test_alerts_are_routed_by_severity(labels: list[str], receiver: str) -> None:
    out = run(tool("amtool"), "config", "routes", "test", f"--config.file={ALERTMANAGER}", *labels)
    assert out.strip() == receiver
