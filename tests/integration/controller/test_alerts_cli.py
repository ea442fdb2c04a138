"""``seawall alerts`` on the real broker: each alert printed as it fired and resolved
(re-publications once), then the alerts active, a stale one marked as such."""

from __future__ import annotations

import asyncio
import io
import time

import pytest
from rich.console import Console

from schemas import Alert, Evidence
from seawall.alerts import run_alerts
from seawall_client.topics import Topics
from services.common.settings import CommonSettings
from services.controller.policy.alerts import AlertBook, AlertConfig, Condition
from tests.fleet import produce

pytestmark = pytest.mark.integration

EVIDENCE = Evidence(reason="error_rate 0.6 > 0.3 over 300s", metrics={"error_rate": 0.6})


def records(now: float) -> list[Alert]:
    """What a controller's book publishes: two alerts fire, one is re-published and
    resolves, the other keeps firing; and one left firing by a controller long gone."""
    book = AlertBook(AlertConfig(republish_s=10, valid_for_s=60))
    pool = Condition("breaker_open", "pool:main", "main", "critical", "pool open", EVIDENCE)
    worker = Condition("heartbeat_lost", "worker:w2", "main", "warning", "w2 silent", EVIDENCE)
    out = book.reconcile([pool, worker], now - 40).records
    out += book.reconcile([pool, worker], now - 25).records  # re-published
    out += book.reconcile([worker], now - 5).records  # the pool's breaker closed
    gone = AlertBook(AlertConfig(republish_s=10, valid_for_s=60))
    degraded = Condition(
        "degradation", "pool:small", "small", "warning", "small degraded", EVIDENCE
    )
    out += gone.reconcile([degraded], now - 600).records
    return out


async def alerts(settings: CommonSettings, show_resolved: bool = False) -> tuple[int, str]:
    out = io.StringIO()
    console = Console(file=out, width=300, color_system=None)
    code = await asyncio.to_thread(run_alerts, settings, show_resolved, False, console)
    return code, out.getvalue()


async def test_prints_changes_once_then_the_active_alerts(
    settings: CommonSettings, topics: Topics
) -> None:
    published = records(time.time())
    assert len(published) == 7  # two fired, three re-published, one resolved, one old
    await produce(settings, topics.alerts, [r.model_dump_json().encode() for r in published])
    await produce(settings, topics.alerts, [b"{not an alert"])
    code, text = await alerts(settings)
    assert code == 0
    assert text.count("FIRING breaker_open pool:main") == 1  # its re-publication: not again
    assert text.count("RESOLVED breaker_open pool:main") == 1
    assert "pool open: error_rate 0.6 > 0.3 over 300s" in text
    assert "skipped a record that is not an alert" in text
    table = text[text.index("alerts active") :]
    assert "alerts active (1)" in table  # the stale one is not counted as active ...
    assert "worker:w2" in table
    assert "stale: not re-published" in table  # ... but shown
    assert "pool:main" not in table
    _, everything = await alerts(settings, show_resolved=True)
    table = everything[everything.index("alerts active") :]
    assert "pool:main" in table
    assert "resolved" in table


async def test_a_missing_alerts_topic_is_an_error(settings: CommonSettings) -> None:
    code, text = await alerts(settings)
    assert code == 1
    assert f"no topic {settings.topic_prefix}llm.alerts" in text
