"""The observability tier runs the real Prometheus tools (Debian packages
``prometheus`` and ``prometheus-alertmanager``: ``promtool``, ``prometheus``,
``amtool``). Where they are missing the tests are skipped with the command that installs
them — except under ``SEAWALL_REQUIRE_PROMETHEUS=1`` (CI installs them and sets it),
where a missing tool fails the test instead of hiding it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is not installed (apt-get install prometheus prometheus-alertmanager)"
    if os.environ.get("SEAWALL_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(message)
    pytest.skip(message)
