"""The controller on the real broker, driving simulated workers with injected faults.

Policies run on scaled time (``SEAWALL_CONTROLLER_TIME_SCALE``): a 300 s window is
15 s here. Every assertion is on events and states, never on how fast they came (the
waits are bounds, not speed claims).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from schemas import (
    Alert,
    BatchLimit,
    BreakerLevel,
    BreakerState,
    ControlEvent,
    DeadLetter,
    DegradationLevel,
    GpuStats,
)
from seawall.embedded import free_port
from seawall_client.kafka import ensure_topics
from seawall_client.serde import ALERT, decode, encode
from seawall_client.topics import Topics
from services.common.bus import make_consumer, make_producer
from services.common.control import ControlFollower
from services.common.control_state import ControlState
from services.common.settings import CommonSettings
from services.controller.service import Controller
from services.controller.settings import ControllerSettings
from services.workers.service import Worker
from tests.fleet import dispatched, produce, sim_worker, until, worker_settings
from tests.integration.controller.conftest import Hook
from tests.signing import headers_for

#: The controller's scaled policy, the same in-process and as a process.
CONTROLLER = {
    "controller_time_scale": 0.05,
    "controller_tick_s": 0.2,
    "controller_republish_s": 1.0,
    "controller_valid_for_s": 10.0,
    "controller_heartbeat_timeout_s": 5.0,
    "controller_session_timeout_s": 6.0,
    # The test's workers share this machine with the whole suite: its CPU says nothing of
    # theirs (as in `seawall up`), and a busy CI machine would trip the CPU row.
    "controller_host_cpu_breaker": False,
}
SAME_DECISION = {"seq", "valid_for_s"}  # what a re-publication changes


class ControlLog:
    """Every control event that changed the state (re-publications included), in the
    order applied; read with the follower admission and workers use."""

    def __init__(self, settings: CommonSettings, topics: Topics) -> None:
        self.events: list[ControlEvent] = []
        self.state = ControlState()
        self.follower = ControlFollower(settings, topics.control, self.state, self.events.append)

    def of(self, key: str) -> list[ControlEvent]:
        return [e for e in self.events if e.control_key == key]

    def latest(self, key: str) -> ControlEvent | None:
        events = self.of(key)
        return events[-1] if events else None

    def first(self, key: str, predicate: Callable[[ControlEvent], bool]) -> ControlEvent | None:
        return next((e for e in self.of(key) if predicate(e)), None)


@asynccontextmanager
async def control_log(settings: CommonSettings, topics: Topics) -> AsyncIterator[ControlLog]:
    log = ControlLog(settings, topics)
    async with log.follower:
        yield log


@asynccontextmanager
async def controller(settings: CommonSettings, **changes: object) -> AsyncIterator[Controller]:
    base = settings.model_dump()
    base.update(CONTROLLER, instance_id="controller")
    base.update(changes)
    async with Controller(ControllerSettings(**base)) as running:
        yield running


@asynccontextmanager
async def worker(settings: CommonSettings, **changes: object) -> AsyncIterator[Worker]:
    defaults: dict[str, object] = {"shutdown_grace_s": 1, "sim_time_scale": 0.2, "batch_limit": 16}
    ws = worker_settings(settings, **(defaults | changes))
    async with sim_worker(ws) as w:
        yield w


async def load(
    settings: CommonSettings, topics: Topics, n: int, max_tokens: int = 30, pool: str = "main"
) -> None:
    """Queue ``n`` requests for the pool (replies go to a topic nobody needs to read)."""
    await ensure_topics(settings.kafka_bootstrap, [topics.reply_spec("load")])
    producer = make_producer(settings)
    await producer.start()
    try:
        topic = topics.dispatch(pool)
        sends = []
        for i in range(n):
            value = encode(dispatched(i, topics.reply("load"), max_tokens=max_tokens, pool=pool))
            sends.append(
                await producer.send(
                    topic, value, key=f"s{i}".encode(), headers=headers_for(settings, topic, value)
                )
            )
        await asyncio.gather(*sends)
    finally:
        await producer.stop()


async def dead_letters(
    settings: CommonSettings, topics: Topics, n: int, timeout_s: float = 30
) -> list[DeadLetter]:
    consumer = make_consumer(settings, topics.deadletter, group_id=None)
    await consumer.start()
    letters: list[DeadLetter] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(letters) < n and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                letters += [DeadLetter.model_validate_json(r.value) for r in records]
    finally:
        await consumer.stop()
    return letters


def breaker_open_on(signal_name: str) -> Callable[[ControlEvent], bool]:
    return lambda e: isinstance(e, BreakerState) and e.state == "open" and signal_name in e.tripped


def limit_is(predicate: Callable[[int], bool]) -> Callable[[ControlEvent], bool]:
    return lambda e: isinstance(e, BatchLimit) and predicate(e.limit)


def hot_gpu(worker: str, pool: str, at: float) -> GpuStats:
    """A reading of one GPU at 95 °C: over the ladder's temperature threshold."""
    return GpuStats(
        worker_id=worker,
        pool=pool,
        gpu_index=0,
        name="sim",
        utilization_pct=90.0,
        memory_used_bytes=1,
        memory_total_bytes=2,
        temperature_c=95.0,
        power_w=300.0,
        power_limit_w=400.0,
        simulated=True,
        at=at,
    )


def level_is(level: int) -> Callable[[ControlEvent], bool]:
    return lambda e: isinstance(e, DegradationLevel) and e.level == level


def limits_of(events: list[ControlEvent]) -> list[int]:
    return [e.limit for e in events if isinstance(e, BatchLimit)]


async def test_faust_fetches_with_our_fetch_wait_not_its_hardcoded_one(
    settings: CommonSettings,
) -> None:
    """faust writes 1,500 ms into its consumer; on the embedded broker every telemetry
    record then waited a share of that before the controller saw it."""
    async with controller(settings, consumer_fetch_max_wait_ms=37) as running:
        fetcher = running.app.consumer._thread._consumer._fetcher  # type: ignore[attr-defined]
        assert fetcher._fetch_max_wait_ms == 37


async def test_injected_latency_shrinks_the_batch_limit_and_the_workers_in_flight(
    settings: CommonSettings, topics: Topics
) -> None:
    async with (
        control_log(settings, topics) as control,
        controller(settings, controller_batch_sla_ms=300.0),
        worker(settings, sim_slowdown=10.0) as w,
    ):
        await load(settings, topics, 400)
        await until(lambda: w.in_flight == 16, timeout_s=60)  # the worker's own limit, used

        key = "batch_limit/worker:w1"
        shrunk = limit_is(lambda limit: limit < 16)
        await until(lambda: control.first(key, shrunk) is not None, 90)
        shrink = control.first(key, shrunk)
        assert isinstance(shrink, BatchLimit)
        assert shrink.limit == 11  # 16 x 0.7
        evidence = shrink.evidence
        assert evidence.metrics["latency_ewma_ms"] > evidence.thresholds["adjusted_sla_ms"]
        assert evidence.thresholds["sla_ms"] == 300.0
        # the latest reports holding at least 30 requests (each summarizes a second's)
        assert evidence.metrics["samples"] >= 30
        assert evidence.previous == "16"

        # It keeps shrinking to the floor and holds there; the worker follows each step.
        await until(lambda: limits_of(control.of(key))[-1] == 4, 60)
        await until(lambda: w.batch_limit == 4, 10)
        limits = limits_of(control.of(key))
        changes = [a for a, b in itertools.pairwise(limits) if a != b] + [limits[-1]]
        assert changes == [16, 11, 7, 4]
        await until(lambda: w.in_flight <= 4, 30)
        samples = []
        for _ in range(100):
            samples.append(w.in_flight)
            await asyncio.sleep(0.02)
        assert max(samples) == 4  # the new limit, used and never exceeded


NOTIFIED = {
    ("breaker_open", "firing", "worker:w1"),
    ("breaker_open", "firing", "pool:main"),
    ("degradation", "firing", "pool:main"),
}


def notified(hook: Hook) -> set[tuple[object, object, object]]:
    """(rule, status, scope) of every alert the webhook was told about."""
    seen: set[tuple[object, object, object]] = set()
    for body in hook.bodies:
        members = body["alerts"]
        assert isinstance(members, list)
        seen |= {(body["rule"], body["status"], a["scope"]) for a in members}
    return seen


async def alerts_on(settings: CommonSettings, topics: Topics, timeout_s: float) -> list[Alert]:
    """Every alert record on the topic (read from its start)."""
    consumer = make_consumer(settings, topics.alerts, group_id=None)
    await consumer.start()
    found: list[Alert] = []
    try:
        await consumer.seek_to_beginning()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=300)
            if not batches and found:
                break
            found += [decode(ALERT, r.value) for rs in batches.values() for r in rs]
    finally:
        await consumer.stop()
    return found


async def test_injected_errors_trip_the_breakers_and_degrade_the_pool(
    settings: CommonSettings, topics: Topics, hook: Hook
) -> None:
    async with (
        control_log(settings, topics) as control,
        controller(
            settings, alert_webhook_url=hook.url, alert_group_wait_s=0.5, alert_republish_s=1.0
        ),
        worker(settings, sim_error_rate=0.6),
    ):
        await load(settings, topics, 300)
        trips = breaker_open_on("error_rate")
        await until(lambda: control.first("breaker/worker:w1", trips) is not None, 60)
        await until(lambda: control.first("breaker/pool:main", trips) is not None, 10)
        await until(lambda: control.first("degradation/pool:main", level_is(2)) is not None, 10)
        # each is an alert on llm.alerts with its decision's evidence, and notified
        await until(lambda: notified(hook) >= NOTIFIED, 20)
        alerts = await alerts_on(settings, topics, 10)
        # what cannot be decoded is dead-lettered with the reason, and the controller goes on
        await produce(settings, topics.telemetry, [b"{not json"])
        (letter,) = await dead_letters(settings, topics, 1)
    assert (letter.reason, letter.excerpt, letter.service) == (
        "invalid_json",
        b"{not json",
        "controller",
    )
    assert letter.source_topic == topics.telemetry
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []  # clean stop

    (first, *_) = control.of("breaker/worker:w1")
    assert isinstance(first, BreakerState)
    assert first.state == "closed"  # from its first sight
    for key in ("breaker/worker:w1", "breaker/pool:main"):
        tripped = control.first(key, trips)
        assert isinstance(tripped, BreakerState)
        assert tripped.level >= BreakerLevel.LOG
        evidence = tripped.evidence
        assert evidence.metrics["error_rate"] > 0.30
        assert evidence.metrics["error_rate.samples"] >= 20
        assert evidence.thresholds["error_rate"] == 0.30
        assert evidence.window_s == pytest.approx(300 * 0.05)
        assert evidence.previous == "closed"
    degraded = control.first("degradation/pool:main", level_is(2))
    assert isinstance(degraded, DegradationLevel)
    assert degraded.max_tokens_cap == 512
    assert degraded.small_pool == "small"
    assert degraded.evidence.metrics["error_rate"] > 0.15

    firing = {(a.rule, a.scope): a for a in alerts if a.status == "firing"}
    assert {("breaker_open", "worker:w1"), ("breaker_open", "pool:main")} <= set(firing)
    assert ("degradation", "pool:main") in firing
    pool_alert = firing[("breaker_open", "pool:main")]
    assert pool_alert.severity == "critical"
    assert pool_alert.evidence.metrics["error_rate"] > 0.30
    assert pool_alert.count == 1


async def test_an_over_temperature_gpu_puts_its_pool_on_static_replies(
    settings: CommonSettings, topics: Topics
) -> None:
    async with (
        control_log(settings, topics) as control,
        controller(settings),
        worker(
            settings, pool="small", sim_over_temperature=True, sim_time_scale=1.0, batch_limit=32
        ),
    ):
        # The simulated board heats 1 °C/s above the temperature its utilization gives:
        # keep it busy (long requests at the simulator's real pace).
        await load(settings, topics, 300, max_tokens=300, pool="small")
        key = "degradation/pool:small"
        await until(lambda: control.first(key, level_is(3)) is not None, 90)

    hot = control.first(key, level_is(3))
    assert isinstance(hot, DegradationLevel)
    assert hot.evidence.metrics["gpu_temperature_c"] > 85.0
    assert hot.evidence.thresholds["gpu_temperature_c"] == 85.0
    assert hot.small_pool is None  # the small pool is not diverted to itself
    assert hot.max_tokens_cap == 512
    assert level_is(0)(control.of(key)[0])


async def test_telemetry_past_a_threshold_is_decided_at_once_not_at_the_next_tick(
    settings: CommonSettings, topics: Topics
) -> None:
    """With a minute between ticks, only the evaluation the record itself causes can
    answer within the wait."""

    def hot(at: float) -> GpuStats:
        return hot_gpu("hot-w1", "reacting", at)

    key = "degradation/pool:reacting"
    async with (
        control_log(settings, topics) as control,
        controller(settings, controller_tick_s=60.0) as running,
    ):
        await until(lambda: running.pools.ready, 30)
        started = time.monotonic()
        while control.first(key, level_is(3)) is None:
            # the controller joins its group and reads from the end: send until it sees one
            assert time.monotonic() - started < 40, "no decision before the next tick"
            await produce(settings, topics.telemetry, [hot(time.time())])
            await asyncio.sleep(0.5)
    decided = control.first(key, level_is(3))
    assert isinstance(decided, DegradationLevel)
    assert decided.evidence.metrics["gpu_temperature_c"] == 95.0


async def test_telemetry_no_worker_macked_moves_nothing_and_a_workers_report_does(
    settings: CommonSettings, topics: Topics
) -> None:
    """A hot GPU reported without a worker's MAC (``hop_signing``, the ``telemetry``
    hop) — unsigned, or MACed with another secret — is read, counted and ignored: no
    degradation; the same report as a worker MACs it degrades the pool."""
    from prometheus_client import REGISTRY

    from services.common.hop_signing import HopKey

    def refused(reason: str) -> float:
        labels = {"hop": "telemetry", "reason": reason}
        return REGISTRY.get_sample_value("seawall_hop_refused_total", labels) or 0.0

    def hot(at: float) -> GpuStats:
        return hot_gpu("forged-w1", "forged", at)

    key = "degradation/pool:forged"
    foreign = HopKey("telemetry", os.urandom(32))
    unsigned, bad_mac = refused("unsigned"), refused("bad_mac")
    producer = make_producer(settings)
    await producer.start()
    try:
        async with (
            control_log(settings, topics) as control,
            controller(settings, controller_tick_s=60.0) as running,
        ):
            await until(lambda: running.pools.ready, 30)
            started = time.monotonic()
            # the controller joins its group and reads from the end: forge until it has
            # read (and refused) some of both kinds
            while refused("unsigned") < unsigned + 3 or refused("bad_mac") < bad_mac + 3:
                assert time.monotonic() - started < 40, "the controller read no forgery"
                value = encode(hot(time.time()))
                await producer.send_and_wait(topics.telemetry, value, key=b"forged")
                await producer.send_and_wait(
                    topics.telemetry,
                    value,
                    key=b"forged",
                    headers=foreign.headers(topics.telemetry, value),
                )
                await asyncio.sleep(0.3)
            await asyncio.sleep(1.0)
            assert control.first(key, level_is(3)) is None

            started = time.monotonic()
            while control.first(key, level_is(3)) is None:
                assert time.monotonic() - started < 40, "a worker's report moved nothing"
                await produce(settings, topics.telemetry, [hot(time.time())])  # MACed
                await asyncio.sleep(0.5)
    finally:
        await producer.stop()


def spawn_controller(
    settings: CommonSettings, metrics_port: int, log: Path
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEAWALL_")}
    env.update(
        SEAWALL_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
        SEAWALL_KAFKA_IDEMPOTENCE=str(settings.kafka_idempotence).lower(),
        SEAWALL_TOPIC_PREFIX=settings.topic_prefix,
        SEAWALL_TOPIC_PARTITIONS=str(settings.topic_partitions),
        SEAWALL_METRICS_PORT=str(metrics_port),
        SEAWALL_CONTROL_KEYS_DIR=str(settings.control_keys_dir or ""),
        SEAWALL_CONTROLLER_BATCH_SLA_MS="300",
        **{f"SEAWALL_{k.upper()}": str(v) for k, v in CONTROLLER.items()},
    )
    # a longer window than the other tests: the restarted controller's windows refill
    # well within the recovery holds even on a loaded machine
    env["SEAWALL_CONTROLLER_TIME_SCALE"] = "0.1"
    # Decisions must outlive a restart, as in production (60 s against a restart of
    # about twice the group session): a restarted controller rejoins its group after
    # about 12 s here, more on a loaded machine, and with 10 s the killed controller's
    # decisions expired at the worker first (its limit went back to its default).
    env["SEAWALL_CONTROLLER_VALID_FOR_S"] = "30"
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services.controller"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def test_a_killed_controller_restarts_with_its_decisions_and_no_contradiction(
    settings: CommonSettings, topics: Topics, tmp_path: Path
) -> None:
    log = tmp_path / "controller.log"
    port = free_port()
    in_force = {
        "breaker/worker:w1": breaker_open_on("error_rate"),
        "breaker/pool:main": breaker_open_on("error_rate"),
        "degradation/pool:main": level_is(2),
        "batch_limit/worker:w1": limit_is(lambda limit: limit == 4),
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        async with (
            control_log(settings, topics) as control,
            # It must go on failing while isolated: the errors are the cause the restarted
            # controller has to remember.
            worker(
                settings,
                sim_error_rate=0.5,
                sim_slowdown=10.0,
                batch_limit=16,
                leave_group_when_isolated=False,
            ) as w,
        ):
            await load(settings, topics, 3000)
            procs.append(spawn_controller(settings, port, log))

            def decided() -> bool:
                return all(
                    (last := control.latest(k)) is not None and ok(last)
                    for k, ok in in_force.items()
                )

            await until(decided, 90)
            # The gauges mirror the state at the end of each tick, which may come a moment
            # after a decision taken on a telemetry record was published.
            wanted = (
                'seawall_controller_breaker_state{scope="worker:w1"} 2.0',
                'seawall_controller_batch_limit{worker="w1"} 4.0',
            )
            async with httpx.AsyncClient() as client:
                deadline = time.monotonic() + 10
                while True:
                    page = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
                    if all(line in page for line in wanted) or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
            for line in wanted:
                assert line in page

            procs[0].send_signal(signal.SIGKILL)
            assert procs[0].wait(timeout=10) == -signal.SIGKILL
            killed_at = time.time()
            before = {k: control.latest(k) for k in in_force}
            # Sequences are at least the microseconds since the epoch when issued: whatever
            # the killed controller published (some of it may not be read yet) is below
            # this, and everything the restarted one publishes is above it.
            last_seq = max(max(e.seq for e in control.events), int(killed_at * 1_000_000))
            procs.append(spawn_controller(settings, port, log))

            def republished() -> bool:
                return all(any(e.seq > last_seq for e in control.of(k)) for k in in_force)

            await until(republished, 60)
            restarted_at = time.monotonic()
            limits: list[int] = []
            # Longer than the error rate's recovery hold (12 s here): had the restarted
            # controller forgotten the errors, the breakers would have closed by now.
            while time.monotonic() - restarted_at < 15:
                limits.append(w.batch_limit)
                await asyncio.sleep(0.1)

            procs[1].send_signal(signal.SIGTERM)
            assert procs[1].wait(timeout=30) == 0, log.read_text()[-3000:]

        for key, ok in in_force.items():
            old = before[key]
            assert old is not None
            after = [e for e in control.of(key) if e.seq > last_seq]
            # kept: re-published as it was (same decision, same decision time)
            assert after[0].model_dump(exclude=SAME_DECISION) == old.model_dump(
                exclude=SAME_DECISION
            ), key
            # and never contradicted while its cause went on
            assert all(ok(e) for e in after), (key, [e.model_dump() for e in after if not ok(e)])
            assert len(after) >= 10  # re-published all along (every second here)
        assert set(limits) == {4}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
