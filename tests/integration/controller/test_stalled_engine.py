"""A worker whose engine hangs (``SEAWALL_SIM_HANG_AFTER_S``) with requests in it, on
the real broker: its telemetry reports the stall, the controller opens its breaker on
``engine_stalled_s`` (isolating it) and raises one ``engine_stalled`` alert — before
the worker's own watchdog (``engine_stall_s``, set long here) would restart it."""

from __future__ import annotations

import pytest

from schemas import BreakerLevel, BreakerState
from seawall_client.topics import Topics
from services.common.settings import CommonSettings
from tests.fleet import until
from tests.integration.controller.test_controller import (
    alerts_on,
    breaker_open_on,
    control_log,
    controller,
    load,
    worker,
)

pytestmark = pytest.mark.integration


async def test_a_hung_engine_is_isolated_and_alerted_on(
    settings: CommonSettings, topics: Topics
) -> None:
    async with (
        control_log(settings, topics) as control,
        controller(settings, alert_group_wait_s=0.5, alert_republish_s=1.0),
        worker(settings, sim_hang_after_s=0.0, engine_stall_s=300.0, request_stall_s=300.0),
    ):
        await load(settings, topics, 4)
        stalled = breaker_open_on("engine_stalled_s")
        await until(lambda: control.first("breaker/worker:w1", stalled) is not None, 60)
        alerts = await alerts_on(settings, topics, 10)
    opened = control.first("breaker/worker:w1", stalled)
    assert isinstance(opened, BreakerState)
    assert opened.level >= BreakerLevel.REJECT_NEW  # isolated from its pool
    assert opened.evidence.metrics["engine_stalled_s"] > 10.0
    assert opened.evidence.thresholds["engine_stalled_s"] == 10.0
    firing = {(a.rule, a.scope): a for a in alerts if a.status == "firing"}
    assert firing[("engine_stalled", "worker:w1")].severity == "critical"
    assert ("breaker_open", "worker:w1") not in firing  # one cause, one alert
