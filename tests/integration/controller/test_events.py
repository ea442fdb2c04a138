"""``seawall events`` on the real broker: reads the control topic from the beginning,
prints each decision once with its evidence, then the decisions in force."""

from __future__ import annotations

import asyncio
import io
import time

from rich.console import Console

from schemas import BatchLimit, BreakerLevel, BreakerState, ControlEvent, Evidence
from seawall.events import run_events
from seawall_client.topics import Topics
from services.common.settings import CommonSettings
from tests.fleet import produce

EVIDENCE = Evidence(
    reason="error_rate 0.6 > 0.3 over 300s",
    window_s=300.0,
    metrics={"error_rate": 0.6, "error_rate.samples": 50.0},
    thresholds={"error_rate": 0.3},
    previous="closed",
)


def events(now: float) -> list[ControlEvent]:
    def breaker(seq: int, scope: str, state: str, valid_for_s: float = 60.0) -> BreakerState:
        return BreakerState(
            scope=scope,
            seq=seq,
            issued_at=now,
            valid_for_s=valid_for_s,
            evidence=EVIDENCE,
            state=state,
            level=BreakerLevel.LOG if state == "open" else BreakerLevel.NONE,
            tripped=("error_rate",) if state == "open" else (),
        )

    limit = BatchLimit(
        scope="worker:w1",
        seq=3,
        issued_at=now,
        worker_id="w1",
        limit=8,
        evidence=Evidence(reason="latency EWMA 900ms > adjusted_sla_ms 600ms"),
    )
    return [
        breaker(1, "worker:w1", "closed"),
        breaker(2, "worker:w1", "open"),
        limit,
        breaker(4, "worker:w1", "open", valid_for_s=65.0),  # a re-publication
        breaker(1, "worker:w1", "closed"),  # a stale duplicate
        breaker(5, "pool:main", "open"),
    ]


async def tail(settings: CommonSettings, scope: str | None, kind: str | None) -> tuple[int, str]:
    out = io.StringIO()
    console = Console(file=out, width=300, color_system=None)
    code = await asyncio.to_thread(run_events, settings, scope, kind, False, console)
    return code, out.getvalue()


async def test_prints_each_decision_once_then_the_decisions_in_force(
    settings: CommonSettings, topics: Topics
) -> None:
    await produce(settings, topics.control, events(time.time()))
    code, text = await tail(settings, None, None)
    assert code == 0
    decisions = [line for line in text.splitlines() if line.startswith("20")]
    assert [line.split()[2] for line in decisions] == [
        "breaker/worker:w1",
        "breaker/worker:w1",
        "batch_limit/worker:w1",
        "breaker/pool:main",
    ]
    assert "open level=LOG tripped=error_rate seq=2" in decisions[1]
    assert "error_rate 0.6 > 0.3 over 300s" in text
    assert "metrics error_rate=0.6 error_rate.samples=50" in text
    assert "decisions in force (3)" in text


async def test_filters_by_scope_and_kind(settings: CommonSettings, topics: Topics) -> None:
    await produce(settings, topics.control, events(time.time()))
    code, text = await tail(settings, "pool:*", "breaker")
    assert code == 0
    assert "breaker/pool:main" in text
    assert "worker:w1" not in text
    assert "decisions in force (1)" in text


async def test_a_missing_control_topic_is_an_error(settings: CommonSettings) -> None:
    code, text = await tail(settings, None, None)
    assert code == 1
    assert f"no topic {settings.topic_prefix}llm.control" in text
