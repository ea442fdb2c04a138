"""The Grafana dashboards are valid provisioning JSON, and ``deploy/README.md`` describes
every panel (the acceptance asks for a screenshot-free description of each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_each_dashboard_is_provisionable_and_described(path: Path) -> None:
    doc = json.loads(path.read_text())
    assert doc["uid"].startswith("seawall-")
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert doc["title"] in readme
    for panel in doc["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        assert f"*{panel['title']}*:" in readme, f"deploy/README.md lacks {panel['title']!r}"
