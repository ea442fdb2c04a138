"""What the deployment tests share: loading a service's settings from the environment a
deployment file gives it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.admission.settings import AdmissionSettings
from services.common.settings import CommonSettings
from services.controller.settings import ControllerSettings
from services.ingress.settings import IngressSettings
from services.workers.settings import WorkerSettings

SETTINGS: dict[str, type[CommonSettings]] = {
    "services.ingress": IngressSettings,
    "services.admission": AdmissionSettings,
    "services.controller": ControllerSettings,
    "services.workers": WorkerSettings,
}
LoadSettings = Callable[[str, dict[str, str]], Any]


@pytest.fixture
def load_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> LoadSettings:
    """``load_settings(module, env)``: the settings of ``python -m module`` run with
    ``env`` and no other SEAWALL_ variable, after checking that ``env`` names only
    settings that exist (pydantic-settings ignores unknown SEAWALL_ variables). A key
    pepper file is replaced by one of the test's (the real one is a secret)."""
    pepper = tmp_path / "key_pepper"
    pepper.write_text("a" * 64)

    def load(module: str, env: dict[str, str]) -> Any:
        settings = SETTINGS[module]
        known = {f"SEAWALL_{field.upper()}" for field in settings.model_fields}
        unknown = {k for k in env if k.startswith("SEAWALL_")} - known
        assert not unknown, f"{module}: no such settings: {sorted(unknown)}"
        with monkeypatch.context() as m:
            for key in os.environ:
                if key.startswith("SEAWALL_"):
                    m.delenv(key)
            for key, value in env.items():
                m.setenv(key, value)
            if "SEAWALL_KEY_PEPPER_FILE" in env:
                m.setenv("SEAWALL_KEY_PEPPER_FILE", str(pepper))
            return settings(_env_file=None)

    return load
