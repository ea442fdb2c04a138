"""A Kafka client that never finishes closing cannot hang a service's stop."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import pytest

from seawall_client import kafka


class _Hangs:
    """Stands for a consumer whose group coordination never ends (aio-libs/aiokafka#773)."""

    def __init__(self) -> None:
        self.cancelled = False

    async def stop(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class _Closes:
    stopped = False

    async def stop(self) -> None:
        self.stopped = True


async def test_a_client_that_hangs_is_abandoned_after_the_bound(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kafka, "CLOSE_TIMEOUT_S", 0.2)
    client = _Hangs()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        await kafka.close(cast(Any, client))
    assert time.monotonic() - started < 2
    assert client.cancelled
    assert "did not close in time" in caplog.text


async def test_a_client_that_closes_is_simply_closed(caplog: pytest.LogCaptureFixture) -> None:
    client = _Closes()
    with caplog.at_level(logging.WARNING):
        await kafka.close(cast(Any, client))
    assert client.stopped
    assert "did not close" not in caplog.text
