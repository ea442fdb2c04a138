"""Hotspot throttles on the real broker: a region's arrivals (as ingress reports them)
surge while a pool's breaker is open; the controller throttles the region at its usual
rate, raises an alert, and lifts the throttle once the surge is over."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from schemas import BreakerLevel, BreakerState, Evidence, RegionArrivals, RegionThrottle
from seawall_client.serde import encode
from seawall_client.topics import Topics
from services.common.bus import make_producer
from services.common.settings import CommonSettings
from tests.fleet import in_background, until
from tests.integration.controller.test_controller import alerts_on, control_log, controller
from tests.signing import send_signed

pytestmark = pytest.mark.integration

TICK_S = 0.1


@contextlib.asynccontextmanager
async def ingress_reports(
    settings: CommonSettings, topics: Topics, rates: dict[str, int]
) -> AsyncIterator[None]:
    """Report ``rates`` (requests per second per region, changeable) as an ingress would,
    ten times a second, until the block ends."""

    async def report() -> None:
        producer = make_producer(settings)
        await producer.start()
        try:
            while True:
                counts = {region: int(rate * TICK_S) for region, rate in rates.items()}
                arrivals = RegionArrivals(
                    instance="i1", at=time.time(), window_s=TICK_S, counts=counts
                )
                await producer.send(topics.arrivals, encode(arrivals), key=b"i1")
                await asyncio.sleep(TICK_S)
        finally:
            await producer.stop()

    async with in_background(report()):
        yield


def pool_breaker(state: str) -> BreakerState:
    return BreakerState(
        scope="pool:main",
        seq=int(time.time() * 1_000_000),
        issued_at=time.time(),
        issuer="controller",
        evidence=Evidence(reason="the test says so"),
        state=state,
        level=BreakerLevel.REJECT_NEW if state == "open" else BreakerLevel.NONE,
    )


async def test_a_surging_region_is_throttled_while_the_fleet_is_hurt_then_lifted(
    settings: CommonSettings, topics: Topics
) -> None:
    rates = {"eu-west": 20, "us-east": 20}
    key = "region_throttle/hotspot:eu-west"
    async with (
        control_log(settings, topics) as control,
        controller(settings, alert_group_wait_s=0.0, alert_republish_s=1.0),
        ingress_reports(settings, topics, rates),
    ):
        await asyncio.sleep(8.0)  # the scaled warmup (6 s): the baselines are learned
        producer = make_producer(settings)
        await producer.start()
        try:
            await send_signed(producer, settings, topics.control, pool_breaker("open"))
            rates["eu-west"] = 200
            await until(lambda: control.latest(key) is not None, 20)
            throttle = control.latest(key)
            rates["eu-west"] = 20  # the surge is over
            await send_signed(producer, settings, topics.control, pool_breaker("closed"))
        finally:
            await producer.stop()
        lifted = lambda: any(  # noqa: E731
            isinstance(e, RegionThrottle) and e.rate_per_s is None for e in control.of(key)
        )
        await until(lifted, 20)
        alerts = await alerts_on(settings, topics, 10)
    assert isinstance(throttle, RegionThrottle)
    assert throttle.region == "eu-west"
    assert throttle.issuer == "controller"
    assert throttle.rate_per_s == pytest.approx(1.5 * 20, rel=0.3)  # its usual rate, not 200
    metrics = throttle.evidence.metrics
    assert metrics["surge_ratio"] > 3
    assert metrics["fleet_hurt"] == 1.0
    assert control.of("region_throttle/hotspot:us-east") == []  # the steady region: untouched
    fired = [a for a in alerts if a.rule == "hotspot_throttle" and a.status == "firing"]
    assert fired
    assert fired[0].scope == "hotspot:eu-west"
    assert fired[0].evidence.metrics["surge_ratio"] > 3
