from __future__ import annotations

import pytest

from services.common.settings import CommonSettings


def test_pools_come_from_a_comma_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEAWALL_POOLS", "main, small,gpu-h100")
    assert CommonSettings().pools == ("main", "small", "gpu-h100")


def test_a_bad_topic_prefix_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEAWALL_TOPIC_PREFIX", "has space")
    with pytest.raises(ValueError, match="topic_prefix"):
        CommonSettings()
