"""Canary releases on the real broker and Redis: ``seawall canary`` commands, the
controller judging two real simulated workers — the pool's own and the canary's — and
the pool's ``TrafficSplit`` as admission and ``seawall canary status`` read it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from schemas import TrafficSplit
from seawall_client.kafka import ensure_topics
from seawall_client.serde import encode
from seawall_client.topics import Topics, canary_pool
from services.admission.policy.config import PolicyConfig
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.settings import AdmissionSettings
from services.common.bus import make_producer
from services.common.control_state import ControlState
from services.common.settings import CommonSettings
from tests.fleet import dispatched, in_background, until
from tests.integration.controller.test_controller import alerts_on, control_log, controller, worker
from tests.integration.test_steer_cli import seawall
from tests.signing import headers_for

pytestmark = pytest.mark.integration

CANARY = canary_pool("main", "v2")
KEY = "traffic_split/pool:main"
_ids = itertools.count()


@contextlib.asynccontextmanager
async def traffic(
    settings: CommonSettings,
    topics: Topics,
    control: ControlState,
    per_s: int,
    shadows: bool = False,
) -> AsyncIterator[None]:
    """``per_s`` requests a second for the pool, each sent to the pool or its canary as
    admission's policy splits it by the control state, until the block ends; the
    replies go to a topic nobody reads. ``shadows``: greedy requests, each ordered a
    shadow run as admission orders them (``consistency_sample`` 1)."""
    tiers = AdmissionSettings(dev_mode=True).tier_configs()
    policy = AdmissionPolicy(PolicyConfig(tiers, consistency_sample=1.0 if shadows else 0.0))
    await ensure_topics(
        settings.kafka_bootstrap, [topics.reply_spec("load"), topics.dispatch_spec(CANARY)]
    )

    async def send() -> None:
        producer = make_producer(settings)
        await producer.start()
        try:
            while True:
                for _ in range(per_s // 10 or 1):
                    i = next(_ids)
                    request = dispatched(
                        i, topics.reply("load"), max_tokens=8, temperature=0.0 if shadows else 1.0
                    )
                    pool = policy.split("main", request.request, control)
                    shadow = policy.shadow_order(request.request, pool, control)
                    topic = topics.dispatch(pool)
                    value = encode(request.model_copy(update={"pool": pool, "shadow": shadow}))
                    await producer.send(
                        topic,
                        value,
                        key=f"s{i}".encode(),
                        headers=headers_for(settings, topic, value),
                    )
                await asyncio.sleep(0.1)
        finally:
            await producer.stop()

    async with in_background(send()):
        yield


def reached(control: Any, phase: str) -> Callable[[], bool]:
    """Whether the pool's split has been in ``phase`` (for ``until``)."""
    return lambda: any(isinstance(e, TrafficSplit) and e.phase == phase for e in control.of(KEY))


def phases(events: list[object]) -> list[tuple[str | None, int]]:
    """The split's (phase, step) changes, in order, without repetitions."""
    out: list[tuple[str | None, int]] = []
    for e in events:
        assert isinstance(e, TrafficSplit)
        if not out or out[-1] != (e.phase, e.step):
            out.append((e.phase, e.step))
    return out


async def test_a_worse_canary_is_rolled_back_with_evidence_and_an_alert_until_aborted(
    settings: CommonSettings, topics: Topics
) -> None:
    async with (
        control_log(settings, topics) as control,
        controller(settings, alert_group_wait_s=0.0, alert_republish_s=1.0),
        worker(settings),
        worker(settings, instance_id="c1", canary_version="v2", sim_error_rate=0.5),
        traffic(settings, topics, control.state, per_s=40),
    ):
        out = seawall(
            settings,
            "canary",
            "start",
            "--pool",
            "main",
            "--version",
            "v2",
            "--steps",
            "10,50,100",
            "--hold",
            "60s",
            "--check",
            "1s",
            "--min-requests",
            "10",
            "--reason",
            "v2 to 10 %",
        )
        assert "canary/pool:main" in out
        await until(reached(control, "rolled_back"), 60)
        alerts = await alerts_on(settings, topics, 10)
        status = seawall(settings, "canary", "status", "--pool", "main")
        seawall(settings, "canary", "abort", "--pool", "main", "--reason", "seen it")
        await until(reached(control, "aborted"), 30)
        await asyncio.sleep(2.5)  # an alert republish period: the resolution is out
        after = await alerts_on(settings, topics, 10)

    assert phases(control.of(KEY))[:3] == [("checking", 0), ("ramping", 0), ("rolled_back", 0)]
    ramping = next(
        e for e in control.of(KEY) if isinstance(e, TrafficSplit) and e.phase == "ramping"
    )
    assert isinstance(ramping, TrafficSplit)
    assert ramping.weights == {"main": pytest.approx(0.9), CANARY: pytest.approx(0.1)}
    assert "check passed" in ramping.evidence.reason
    back = next(
        e for e in control.of(KEY) if isinstance(e, TrafficSplit) and e.phase == "rolled_back"
    )
    assert isinstance(back, TrafficSplit)
    assert back.weights == {"main": 1.0}  # all of the pool's traffic back on its own workers
    assert back.issuer == "controller"
    assert "error rate" in back.evidence.reason
    limit = back.evidence.thresholds["canary_error_rate"]
    assert limit < 0.1  # the baseline's (no injected errors) plus the 2 % allowed
    assert back.evidence.metrics["canary_error_rate"] > limit
    assert back.evidence.metrics["canary_requests"] >= 10
    assert back.evidence.previous == "ramping step 1/3 at 10%"
    firing = [a for a in alerts if a.rule == "canary_rollback" and a.status == "firing"]
    assert firing
    assert (firing[0].scope, firing[0].severity) == ("pool:main", "critical")
    assert "rolled back" in status
    resolved = [a for a in after if a.rule == "canary_rollback" and a.status == "resolved"]
    assert resolved


async def test_a_canary_whose_outputs_diverge_is_rolled_back_on_its_mismatch_rate(
    settings: CommonSettings, topics: Topics
) -> None:
    """No errors, no slowness: only its outputs differ from the pool's, which the
    shadows of the pool's greedy requests, run on the canary, show."""
    async with (
        control_log(settings, topics) as control,
        controller(settings),
        worker(settings),
        worker(settings, instance_id="c1", canary_version="v2", sim_divergence=1.0),
        traffic(settings, topics, control.state, per_s=40, shadows=True),
    ):
        seawall(
            settings,
            "canary",
            "start",
            "--pool",
            "main",
            "--version",
            "v2",
            "--steps",
            "10,100",
            "--hold",
            "60s",
            "--check",
            "1s",
            "--min-requests",
            "10",
            "--max-latency-ratio",
            "100",
            "--max-ttft-ratio",
            "100",
        )
        await until(reached(control, "rolled_back"), 60)
    back = next(
        e for e in control.of(KEY) if isinstance(e, TrafficSplit) and e.phase == "rolled_back"
    )
    assert isinstance(back, TrafficSplit)
    assert "output mismatch rate" in back.evidence.reason
    assert "error rate" not in back.evidence.reason
    assert back.evidence.metrics["canary_mismatch_rate"] > 0.5
    assert back.evidence.metrics["canary_consistency_checks"] >= 10
    assert back.evidence.thresholds["canary_mismatch_rate"] == pytest.approx(0.05)


async def test_a_healthy_canary_is_promoted_step_by_step(
    settings: CommonSettings, topics: Topics
) -> None:
    async with (
        control_log(settings, topics) as control,
        controller(settings),
        worker(settings),
        worker(settings, instance_id="c1", canary_version="v2"),
        traffic(settings, topics, control.state, per_s=40),
    ):
        seawall(
            settings,
            "canary",
            "start",
            "--pool",
            "main",
            "--version",
            "v2",
            "--steps",
            "20,100",
            "--hold",
            "3s",
            "--check",
            "1s",
            "--min-requests",
            "10",
            # the two arms share one CPU here: latency is compared in the unit tests
            "--max-latency-ratio",
            "10",
            "--max-ttft-ratio",
            "10",
        )
        await until(reached(control, "promoted"), 60)
    assert phases(control.of(KEY)) == [
        ("checking", 0),
        ("ramping", 0),
        ("ramping", 1),
        ("promoted", 1),
    ]
    final = control.latest(KEY)
    assert isinstance(final, TrafficSplit)
    assert final.weights == {CANARY: 1.0}
    assert final.evidence.hold_s is not None
    assert final.evidence.hold_s >= 3


async def test_promote_gives_the_canary_all_the_traffic_at_once(
    settings: CommonSettings, topics: Topics
) -> None:
    """An operator's promote ends the release from any phase, the check included (no
    worker needs to report for it)."""
    async with control_log(settings, topics) as control, controller(settings):
        seawall(settings, "canary", "start", "--pool", "main", "--version", "v2", "--hold", "1h")
        await until(reached(control, "checking"), 30)
        out = seawall(settings, "canary", "promote", "--pool", "main", "--reason", "ship it")
        assert "promote canary v2" in out
        await until(lambda: phases(control.of(KEY))[-1:] == [("promoted", 0)], 30)
    final = control.latest(KEY)
    assert isinstance(final, TrafficSplit)
    assert final.weights == {CANARY: 1.0}
    assert final.evidence.reason == "an operator's promote"
    assert final.evidence.previous == "checking"
