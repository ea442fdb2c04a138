"""Which event loop a service runs on (``services.common.main.loop_factory``)."""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

import pytest
import uvloop

from services.common.main import loop_factory
from services.common.settings import CommonSettings


def test_auto_and_uvloop_run_on_uvloop() -> None:
    for choice in ("auto", "uvloop"):
        factory = loop_factory(choice)
        assert factory is not None
        with asyncio.Runner(loop_factory=factory) as runner:
            assert isinstance(runner.get_loop(), uvloop.Loop)


def test_asyncio_is_the_standard_loop() -> None:
    assert loop_factory("asyncio") is None


def test_auto_falls_back_where_uvloop_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert loop_factory("auto") is None
    with pytest.raises(ImportError):
        loop_factory("uvloop")


def test_the_setting_defaults_to_auto_and_refuses_others(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CommonSettings().event_loop == "auto"
    monkeypatch.setenv("SEAWALL_EVENT_LOOP", "trio")
    with pytest.raises(ValueError, match="event_loop"):
        CommonSettings()
