"""Output consistency on the real broker and Redis: admission samples greedy requests,
their workers send shadows to the other worker of the pool, which compares; a pool
whose outputs agree stays quiet, and a worker whose outputs diverge raises the
controller's ``output_inconsistency`` alert."""

from __future__ import annotations

import itertools
import time

from prometheus_client import REGISTRY

from schemas import Alert
from seawall_client.kafka import ensure_topics
from seawall_client.topics import Topics
from services.admission.service import Admission
from services.common.settings import CommonSettings
from tests.admission_helpers import admission_settings, inference_request, send_all, started
from tests.fleet import sim_worker, until, worker_settings
from tests.integration.controller.test_controller import alerts_on, controller

_n = itertools.count()


def checks(outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "seawall_worker_consistency_checks_total", {"pool": "main", "outcome": outcome}
    )
    return value or 0.0


async def greedy_burst(settings: CommonSettings, topics: Topics, replies: str, n: int) -> None:
    requests = [
        inference_request(f"greedy-{next(_n)}", replies, temperature=0.0, max_tokens=12)
        for _ in range(n)
    ]
    await send_all(settings, topics.requests(requests[0].priority), requests)


async def test_agreeing_outputs_stay_quiet_and_a_diverging_worker_raises_the_alert(
    settings: CommonSettings, topics: Topics
) -> None:
    replies = topics.reply("consistency")
    await ensure_topics(settings.kafka_bootstrap, [topics.reply_spec("consistency")])
    admission = Admission(admission_settings(settings, consistency_sample=1.0))
    fleet = {"sim_time_scale": 0.05, "pool": "main"}
    w1 = sim_worker(worker_settings(settings, instance_id="w1", **fleet))
    w2 = sim_worker(worker_settings(settings, instance_id="w2", **fleet))
    agreed, differed = checks("agree"), checks("differ")
    async with controller(settings), started(admission, w1, w2):
        # Phase 1: two healthy workers. Every shadow that reaches the other worker agrees.
        await greedy_burst(settings, topics, replies, 40)
        await until(lambda: checks("agree") - agreed >= 10, 60)
        assert checks("differ") == differed
        # Phase 2: w2 is replaced by a worker whose outputs diverge.
        await w2.stop()
        diverging_since = time.time()
        diverging = sim_worker(
            worker_settings(settings, instance_id="w3", sim_divergence=1.0, **fleet)
        )
        async with started(diverging):
            await greedy_burst(settings, topics, replies, 60)
            await until(lambda: checks("differ") - differed >= 10, 90)
            found = await inconsistency_alerts(settings, topics, 60)
    (first, *_) = found
    assert (first.scope, first.status, first.severity) == ("pool:main", "firing", "warning")
    assert first.first_seen >= diverging_since  # not while the outputs agreed
    assert first.evidence.metrics["output_mismatch_rate"] > 0.10
    assert first.evidence.metrics["output_mismatch_rate.samples"] >= 10


async def inconsistency_alerts(
    settings: CommonSettings, topics: Topics, timeout_s: float
) -> list[Alert]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alerts = await alerts_on(settings, topics, 5)
        found = [a for a in alerts if a.rule == "output_inconsistency"]
        if found:
            return found
    raise AssertionError("no output_inconsistency alert")
