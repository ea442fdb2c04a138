"""The whole control loop on the real broker: a worker whose engine fails requests →
telemetry → the controller's decisions → admission changes what it dispatches, and
the worker's own in-flight limit follows its BatchLimit."""

from __future__ import annotations

import asyncio
import time

from schemas import BreakerState, DegradationLevel, Priority, Tier
from seawall_client.kafka import ensure_topics
from seawall_client.topics import Topics
from services.admission.service import Admission
from services.common.settings import CommonSettings
from tests.admission_helpers import (
    TopicReader,
    admission_settings,
    inference_request,
    send_all,
    started,
)
from tests.fleet import in_background, sim_worker, until, worker_settings
from tests.integration.controller.test_controller import control_log, controller, level_is


async def test_controller_decisions_change_what_admission_dispatches(
    settings: CommonSettings, topics: Topics
) -> None:
    replies = topics.reply("closed-loop")
    await ensure_topics(settings.kafka_bootstrap, [topics.reply_spec("closed-loop")])
    admission = Admission(admission_settings(settings))
    # 20 % errors: past the ladder's 15 % (level 2) but under the breaker's 30 % trip
    # (the default, decided on the Wilson lower bound of the rate: the first 20-odd
    # completions of a 20 % worker, its failures first, no longer isolate it), so the
    # worker stays in its pool and the pool stays degraded while traffic flows.
    worker = sim_worker(worker_settings(settings, sim_error_rate=0.2, sim_time_scale=0.2))
    spare = sim_worker(
        worker_settings(settings, instance_id="w2", pool="small", sim_time_scale=0.2)
    )
    main, small = topics.dispatch("main"), topics.dispatch("small")
    async with (
        control_log(settings, topics) as control,
        # Windows of 12 s (time scale 0.2): enough samples even on a loaded machine.
        controller(settings, controller_time_scale=0.2),
        started(admission, worker, spare),
        TopicReader(settings, main, small) as reader,
    ):
        # Steady traffic through admission, all along: standard work, and VIP work that
        # is never diverted, so the failing pool keeps showing its errors (a quiet pool
        # counts as healthy).
        async def traffic() -> None:
            for n in range(100_000):
                vip = inference_request(
                    f"warm-vip-{n}",
                    replies,
                    tenant="vip-co",
                    tier=Tier.ENTERPRISE,
                    priority=Priority.VIP,
                )
                await send_all(settings, topics.requests(Priority.VIP), [vip])
                if n % 5 == 0:  # a trickle: nothing queues long behind it once diverted
                    standard = inference_request(f"warm-{n}", replies, tenant="std-co")
                    await send_all(settings, topics.requests(Priority.STANDARD), [standard])
                await asyncio.sleep(0.1)

        async with (
            in_background(traffic()),
            asyncio.timeout(180),
        ):  # fail with a reason, never hang CI
            key = "degradation/pool:main"
            await until(lambda: control.first(key, level_is(2)) is not None, 90)
            degraded = control.first(key, level_is(2))
            assert isinstance(degraded, DegradationLevel)

            def applied() -> bool:
                event = admission.control.get(DegradationLevel, "pool:main")
                return event is not None and event.level >= 2

            await until(applied)
            # A long standard request is now diverted and capped; a long VIP one capped only.
            standard = inference_request(
                "after-standard", replies, tenant="late-co", max_tokens=2000
            )
            vip = inference_request(
                "after-vip",
                replies,
                tenant="late-vip-co",
                max_tokens=2000,
                tier=Tier.ENTERPRISE,
                priority=Priority.VIP,
            )
            await send_all(settings, topics.requests(Priority.STANDARD), [standard])
            await send_all(settings, topics.requests(Priority.VIP), [vip])

            def seen(rid: str) -> bool:
                return any(
                    d.request.request_id == rid for t in (main, small) for d in reader.dispatched(t)
                )

            deadline = time.monotonic() + 60
            while not (seen("after-standard") and seen("after-vip")):
                assert time.monotonic() < deadline, "the requests were not dispatched"
                await reader.poll()

    # The 20 % worker was never isolated for its errors (decided on evidence, at 30 %).
    breakers = [e for e in control.events if isinstance(e, BreakerState)]
    assert not [e for e in breakers if "error_rate" in e.tripped], breakers
    (to_small,) = [d for d in reader.dispatched(small) if d.request.request_id == "after-standard"]
    assert to_small.pool == "small"
    assert to_small.degradation.level >= 2
    assert to_small.degradation.diverted_from == "main"
    assert to_small.degradation.max_tokens_cap == degraded.max_tokens_cap
    # VIP is never diverted. (Whether it is capped depends on when it is dispatched: a
    # pool that goes quiet recovers.)
    (vip_main,) = [d for d in reader.dispatched(main) if d.request.request_id == "after-vip"]
    assert vip_main.degradation.diverted_from is None
    # Before the degradation, the same traffic went to its own pool untouched.
    before = [d for d in reader.dispatched(main) if d.request.request_id == "warm-0"]
    assert [d.degradation.level for d in before] == [0]
