"""The Alertmanager configuration at work in the real Alertmanager (Debian package
``prometheus-alertmanager``): the inhibition rules mute what they promise to mute, and
nothing else."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from seawall.embedded import free_port
from tests.observability.conftest import DEPLOY, tool

ALERTMANAGER = DEPLOY / "alertmanager" / "alertmanager.yml"


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    """Alertmanager with seawall's configuration on a free port, clustering off."""
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            tool("prometheus-alertmanager"),
            f"--config.file={ALERTMANAGER}",
            f"--storage.path={tmp_path}",
            f"--web.listen-address={url.removeprefix('http://')}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
            assert time.monotonic() < deadline, "alertmanager did not get ready"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def alert(rule: str, scope: str, pool: str, severity: str) -> dict[str, object]:
    """An alert as the Prometheus rule forwarding the controller's alerts labels it."""
    return {
        "labels": {
            "alertname": "SeawallControllerAlert",
            "rule": rule,
            "scope": scope,
            "pool": pool,
            "severity": severity,
        },
        "annotations": {"summary": f"{rule} on {scope}"},
    }


def test_a_pools_open_breaker_mutes_its_workers_alerts_only(alertmanager: str) -> None:
    sent = [
        alert("breaker_open", "pool:main", "main", "critical"),
        alert("breaker_open", "worker:w1", "main", "warning"),
        alert("heartbeat_lost", "worker:w2", "main", "warning"),
        alert("breaker_open", "worker:w9", "small", "warning"),  # another pool
        alert("degradation", "pool:main", "main", "critical"),
        alert("degradation", "pool:main", "main", "warning"),  # a lower rung
        alert("degradation", "pool:small", "small", "warning"),
    ]
    posted = httpx.post(f"{alertmanager}/api/v2/alerts", json=sent, timeout=10)
    assert posted.status_code == 200, posted.text
    state = {}
    deadline = time.monotonic() + 20
    while len(state) < len(sent) and time.monotonic() < deadline:
        listed = httpx.get(f"{alertmanager}/api/v2/alerts", timeout=10).json()
        state = {
            (a["labels"]["rule"], a["labels"]["scope"], a["labels"]["severity"]): a["status"][
                "state"
            ]
            for a in listed
        }
        time.sleep(0.1)
    assert state == {
        ("breaker_open", "pool:main", "critical"): "active",
        ("breaker_open", "worker:w1", "warning"): "suppressed",
        ("heartbeat_lost", "worker:w2", "warning"): "suppressed",
        ("breaker_open", "worker:w9", "warning"): "active",
        ("degradation", "pool:main", "critical"): "active",
        ("degradation", "pool:main", "warning"): "suppressed",
        ("degradation", "pool:small", "warning"): "active",
    }
