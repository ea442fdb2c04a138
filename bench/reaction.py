"""Reaction time: the first telemetry record past a threshold → the control event applied
at admission and at a worker.

Runs the real control loop on the embedded broker (Tansu, started on a free port and
stopped at the end): the controller as its own process (``python -m services.controller``,
as ``seawall up`` runs it) with a short tick and scaled policy windows, and two
follower processes standing for admission and a worker. Each follower is the
``ControlFollower`` admission and workers construct (groupless, from the beginning of
the control topic, latest ``seq`` wins); "applied" is the moment its ``on_change``
callback fires in that process, which is where ``Admission._on_control`` and
``Worker._on_control`` run. This script plays one fake worker (``bench-w1`` in pool
``main``) that reports like a real one (heartbeat, engine stats, GPU stats and completed
requests every ``50 × time_scale`` s, longer than the scaled GPU windows), keyed by its
pool as workers key theirs (so the controller decides each record on the partition it
reads it from).

Per trial, once both followers have seen the pool and the worker healthy again, one GPU
sample is hot and leaking: 95 °C (the degradation ladder's rung 3 trips above 85 °C on
the window's maximum → ``DegradationLevel`` 3 for ``pool:main``, which admission
applies) and all of the memory headroom in use (the breaker's GPU-memory row trips above
85 % on the window's mean → ``BreakerState`` open at level 4, emergency restart, for
``worker:bench-w1``, which the worker applies). Neither trigger has a trip hold, so what
is measured is the loop, not the policy's patience: telemetry topic → the controller's
route agent (which decides a record on its pool's partition itself) → the evaluation
the record causes → changelog flush → control topic → the follower. The trigger is the
only GPU sample in its window: none for ``QUIET_ROUNDS`` rounds before it, none after
it until both reactions were seen. Healthy samples then resume, and the next trial
waits for the recovery (level 0, the breaker closed after the half-open probes).

- ``t0``: the broker acked the trigger record (``time.time()`` in this process);
- ``t1``: ``on_change`` fired for the resulting event in the follower process
  (``time.time()``, the same machine clock).

Baseline, measured in the same run between trials: a control event produced straight to
the control topic (a scope no one decides for) → the same followers' ``on_change``: the
broker's own round trip through the same consumer, so the ratio is what the controller
adds over Kafka.

Usage: ``python bench/reaction.py [--trials 35] [--tick 0.05] [--time-scale 0.01]``.
Writes ``bench/results/reaction.json`` and ``.png``; prints ratios against the baseline
measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from queue import Empty
from typing import Any

from _common import (
    EMBEDDED_BROKER,
    GPU_RESERVED,
    HEALTHY_TEMP_C,
    HOT_TEMP_C,
    RESULTS,
    commit,
    control_keys,
    embedded_broker,
    engine_stats,
    fmt,
    gpu_stats,
    heartbeat,
    machine,
    ratio,
    spawn_controller,
    stop_controller,
    summary,
    worker_mac,
)
from aiokafka import AIOKafkaProducer

from schemas import (
    BreakerState,
    ControlEvent,
    DegradationLevel,
    Evidence,
    GpuStats,
    WorkerReport,
)
from seawall import embedded
from seawall_client.kafka import ensure_topics
from seawall_client.serde import encode
from services.common.bus import make_producer, topics_of
from services.common.control import ControlFollower
from services.common.control_state import ControlState
from services.common.settings import CommonSettings
from services.workers.policy.summary import RequestSummarizer

ROLES = ("admission", "worker")
POOL = "main"
WORKER = "bench-w1"
DEGRADATION_KEY = f"degradation/pool:{POOL}"
BREAKER_KEY = f"breaker/worker:{WORKER}"
BASELINE_KEY = "degradation/pool:bench-baseline"
PROBES_PER_SAMPLE = 3
"""Completed requests per telemetry round: the breaker's three half-open probes pass in
one round, so recovery does not wait on request pacing."""
QUIET_ROUNDS = 3
"""Rounds without a GPU sample before a trigger (and none after it until the reaction was
seen): the controller must not take a healthy sample into the same window as the hot
one, or the memory row's mean would hold both and not trip. The rounds are many because
on the embedded broker the consumers fetch up to half their ``fetch_max_wait`` late
(faust's is 1.5 s), so samples sent a second apart can arrive in one batch."""
SAMPLE_PERIODS_PER_SCALE = 50.0
"""Telemetry every ``50 × time_scale`` s: longer than the scaled GPU windows (``33 ×
time_scale`` s with their last bucket), so that one sample can be a window alone."""
PING_PHASE_S = 0.5
"""The followers' fetch wait (aiokafka's default ``fetch_max_wait_ms``)."""
REACTION_TIMEOUT_S = 10.0
RECOVERY_TIMEOUT_S = 20.0
STARTUP_TIMEOUT_S = 120.0


# -- followers (their own processes) ------------------------------------------------------
def _follower_main(role: str, settings: dict[str, Any], out: Queue[Any], stop: Event) -> None:
    asyncio.run(_follow(role, CommonSettings(_env_file=None, **settings), out, stop))


async def _follow(role: str, settings: CommonSettings, out: Queue[Any], stop: Event) -> None:
    def on_change(event: ControlEvent) -> None:
        at = time.time()
        state = event.state if isinstance(event, BreakerState) else ""
        level = int(event.level) if isinstance(event, BreakerState | DegradationLevel) else -1
        tripped = event.tripped if isinstance(event, BreakerState) else ()
        out.put((role, at, event.control_key, event.seq, event.issued_at, state, level, tripped))

    follower = ControlFollower(settings, topics_of(settings).control, ControlState(), on_change)
    async with follower:
        out.put((role, time.time(), "", 0, 0.0, "ready", -1, ()))
        await asyncio.to_thread(stop.wait)


@dataclass(frozen=True)
class Applied:
    """One ``on_change`` call in a follower process."""

    role: str
    at: float
    key: str
    seq: int
    issued_at: float
    """When the controller decided (its clock: the same machine's)."""
    state: str
    level: int
    tripped: tuple[str, ...]


class Followers:
    """The follower processes and every event they applied, in arrival order."""

    def __init__(self, settings: CommonSettings) -> None:
        ctx = mp.get_context("spawn")
        self._queue: Queue[Any] = ctx.Queue()
        self._stop = ctx.Event()
        fields = {
            "kafka_bootstrap": settings.kafka_bootstrap,
            "kafka_idempotence": settings.kafka_idempotence,
            "topic_prefix": settings.topic_prefix,
            "redis_url": settings.redis_url,
            "redis_prefix": settings.redis_prefix,
            "kafka_doorbell": settings.kafka_doorbell,
            "consumer_fetch_busy_wait_ms": settings.consumer_fetch_busy_wait_ms,
        }
        self._procs = [
            ctx.Process(
                target=_follower_main,
                args=(role, {**fields, "instance_id": f"bench-{role}"}, self._queue, self._stop),
                name=f"follower-{role}",
            )
            for role in ROLES
        ]
        self.log: list[Applied] = []
        self.latest: dict[tuple[str, str], Applied] = {}

    def start(self) -> None:
        for proc in self._procs:
            proc.start()

    def stop(self) -> None:
        self._stop.set()
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)

    def drain(self) -> None:
        while True:
            try:
                applied = Applied(*self._queue.get_nowait())
            except Empty:
                return
            self.log.append(applied)
            self.latest[applied.role, applied.key] = applied

    async def wait(self, found: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain()
            if found():
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)

    async def applied_since(
        self, index: int, matches: Mapping[str, Callable[[Applied], bool]]
    ) -> dict[str, Applied]:
        """What each role first applied of the matching events from ``log[index:]`` on;
        a role that applied none within ``REACTION_TIMEOUT_S`` is left out."""
        found: dict[str, Applied] = {}

        def complete() -> bool:
            for a in self.log[index:]:
                if a.role not in found and matches[a.role](a):
                    found[a.role] = a
            return len(found) == len(matches)

        await self.wait(complete, REACTION_TIMEOUT_S)
        return found

    def is_latest(self, role: str, key: str, match: Callable[[Applied], bool]) -> bool:
        applied = self.latest.get((role, key))
        return applied is not None and match(applied)


def degraded(a: Applied) -> bool:
    return a.key == DEGRADATION_KEY and a.level == 3


def pool_healthy(a: Applied) -> bool:
    return a.key == DEGRADATION_KEY and a.level == 0


def isolated(a: Applied) -> bool:
    return a.key == BREAKER_KEY and a.state == "open" and "gpu_memory_percent" in a.tripped


def worker_healthy(a: Applied) -> bool:
    return a.key == BREAKER_KEY and a.state == "closed"


# -- the fake worker's telemetry ------------------------------------------------------------
class FakeWorker:
    """Reports like a worker every ``period_s`` (± 10 %, so that triggers fall at random
    phases of the controller's tick and of the consumers' fetches). ``arm()``: after
    ``QUIET_ROUNDS`` rounds without a GPU sample, the next one is the trigger; then no
    GPU sample until ``resume()``."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, period_s: float) -> None:
        self._producer = producer
        self._topic = topic
        self._period_s = period_s
        self._started_at = time.time()
        self._armed: asyncio.Future[tuple[float, float]] | None = None
        self._idle_s = 0.0
        self._quiet = False

    def arm(self, idle_s: float = 0.0) -> asyncio.Future[tuple[float, float]]:
        """When the trigger record was sent and when the broker acked it. With
        ``idle_s``: nothing at all is reported for that long, and the trigger is the
        first record after the silence."""
        self._armed = asyncio.get_running_loop().create_future()
        self._idle_s = idle_s
        return self._armed

    def resume(self) -> None:
        """Healthy GPU samples again."""
        self._quiet = False

    async def run(self) -> None:
        rounds = 0
        while True:
            trigger = self._armed
            if trigger is not None and self._idle_s:
                await asyncio.sleep(self._idle_s)
                rounds, self._idle_s = QUIET_ROUNDS, 0.0
            if trigger is not None and rounds == QUIET_ROUNDS:
                rounds, self._armed, self._quiet = 0, None, True
                sent = time.time()
                trigger.set_result((sent, await self._report(hot=True)))
            elif trigger is not None:
                rounds += 1
                await self._report(hot=None)
            else:
                await self._report(hot=None if self._quiet else False)
            await asyncio.sleep(self._period_s * random.uniform(0.9, 1.1))

    async def _report(self, *, hot: bool | None) -> float:
        """One round, its GPU sample (none if ``hot`` is None) sent first; returns when
        the broker acked that sample."""
        now = time.time()
        key = POOL.encode()  # as seawall's workers key theirs: the pool's partition
        messages: list[GpuStats | WorkerReport] = []
        if hot is not None:
            temperature_c, memory_share = (
                (HOT_TEMP_C, 1.0) if hot else (HEALTHY_TEMP_C, GPU_RESERVED)
            )
            messages.append(gpu_stats(WORKER, POOL, now, temperature_c, memory_share))
        messages += self._others(now)
        values = [encode(m) for m in messages]
        sends = [
            await self._producer.send(self._topic, v, key=key, headers=worker_mac(self._topic, v))
            for v in values
        ]
        await sends[0]
        acked = time.time()
        await asyncio.gather(*sends)
        return acked

    def _others(self, now: float) -> list[WorkerReport]:
        """The rest of the worker's report: heartbeat, engine, and its requests (healthy
        ones: the breaker's half-open probes pass on them)."""
        summary = RequestSummarizer(now - self._period_s)
        for _ in range(PROBES_PER_SAMPLE):
            summary.add(120.0, True, prompt_tokens=100, completion_tokens=50)
        return [
            WorkerReport(
                worker_id=WORKER,
                pool=POOL,
                at=now,
                heartbeat=heartbeat(WORKER, POOL, now, in_flight=2, started_at=self._started_at),
                engine=engine_stats(
                    WORKER, POOL, now, in_flight=2, kv_cache_usage=0.2, kv_capacity_tokens=500_000
                ),
                requests=summary.take(now),
            )
        ]


# -- the measurement ----------------------------------------------------------------------
def _per_role() -> dict[str, list[float]]:
    return {r: [] for r in ROLES}


@dataclass
class Samples:
    """Milliseconds, per role."""

    reaction: dict[str, list[float]] = field(default_factory=_per_role)
    to_decision: dict[str, list[float]] = field(default_factory=_per_role)
    """t0 → the controller's decision (``issued_at``): the part of the reaction spent
    before the control event was published."""
    baseline: dict[str, list[float]] = field(default_factory=_per_role)
    after_idle: dict[str, list[float]] = field(default_factory=_per_role)
    """The reaction to a trigger that is the first telemetry after ``--idle-s`` of none
    (heartbeats included, so the worker is also isolated as lost meanwhile)."""
    missed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    produce_ack_ms: list[float] = field(default_factory=list)


async def ping(
    producer: AIOKafkaProducer, topic: str, followers: Followers, seq: int
) -> dict[str, float]:
    """One control event straight to the control topic; ms until each follower applied
    it (a follower that did not within the timeout is left out)."""
    await asyncio.sleep(random.uniform(0.0, PING_PHASE_S))  # a random phase of the fetches
    event = DegradationLevel(
        scope="pool:bench-baseline",
        seq=seq,
        issued_at=time.time(),
        evidence=Evidence(reason="reaction benchmark baseline"),
        level=0,
    )
    index = len(followers.log)
    await producer.send_and_wait(topic, encode(event), key=event.control_key.encode())
    t0 = time.time()
    applied = await followers.applied_since(
        index, dict.fromkeys(ROLES, lambda a: a.key == BASELINE_KEY and a.seq == seq)
    )
    return {role: (a.at - t0) * 1000 for role, a in applied.items()}


async def measure(
    settings: CommonSettings,
    followers: Followers,
    worker: FakeWorker,
    producer: AIOKafkaProducer,
    trials: int,
    warmup: int,
    pings: int,
    idle_trials: int,
    idle_s: float,
) -> Samples:
    # The controller reads telemetry from the end once it joins its group: it is ready
    # when both followers saw its first decisions about this pool and this worker.
    if not await followers.wait(lambda: healthy(followers), STARTUP_TIMEOUT_S):
        raise RuntimeError("the controller made no decision in time")
    control = topics_of(settings).control
    out = Samples()
    matches = {"admission": degraded, "worker": isolated}
    for trial in range(warmup + trials + idle_trials):
        if not await followers.wait(lambda: healthy(followers), RECOVERY_TIMEOUT_S):
            raise RuntimeError(f"trial {trial}: the pool and the worker did not recover")
        index = len(followers.log)
        after_idle = trial >= warmup + trials
        sent, t0 = await worker.arm(idle_s if after_idle else 0.0)
        applied = await followers.applied_since(index, matches)
        worker.resume()
        if after_idle:
            for role in ROLES:
                if role in applied:
                    out.after_idle[role].append((applied[role].at - t0) * 1000)
                else:
                    out.missed[role] += 1
            continue
        if trial >= warmup:
            out.produce_ack_ms.append((t0 - sent) * 1000)
            for role in ROLES:
                if role in applied:
                    out.reaction[role].append((applied[role].at - t0) * 1000)
                    out.to_decision[role].append((applied[role].issued_at - t0) * 1000)
                else:
                    out.missed[role] += 1
        for i in range(pings):
            seq = trial * pings + i + 1
            for role, ms in (await ping(producer, control, followers, seq)).items():
                if trial >= warmup:
                    out.baseline[role].append(ms)
    return out


def stack_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What ``seawall up`` sets on the embedded broker (``--as-seawall-up``): the
    doorbell and the busy fetch wait; nothing otherwise (every fetch waits 50 ms)."""
    if not args.as_seawall_up:
        return {}
    return {"kafka_doorbell": True, "consumer_fetch_busy_wait_ms": embedded.FETCH_BUSY_WAIT_MS}


def controller_env(args: argparse.Namespace, settings: CommonSettings) -> dict[str, str]:
    if not args.as_seawall_up:
        return {}
    return {
        "SEAWALL_KAFKA_DOORBELL": "true",
        "SEAWALL_REDIS_URL": settings.redis_url,
        "SEAWALL_REDIS_PREFIX": settings.redis_prefix,
        "SEAWALL_CONSUMER_FETCH_BUSY_WAIT_MS": str(embedded.FETCH_BUSY_WAIT_MS),
        "SEAWALL_CONTROLLER_FETCH_MAX_WAIT_MS": str(embedded.CONTROLLER_FETCH_WAIT_MS),
    }


def healthy(followers: Followers) -> bool:
    return followers.is_latest("admission", DEGRADATION_KEY, pool_healthy) and followers.is_latest(
        "worker", BREAKER_KEY, worker_healthy
    )


async def run(args: argparse.Namespace, workdir: Path) -> Samples:
    async with embedded_broker(workdir) as bootstrap:
        tag = uuid.uuid4().hex[:8]
        settings = CommonSettings(
            _env_file=None,
            control_keys_dir=control_keys(),
            kafka_bootstrap=bootstrap,
            kafka_idempotence=False,
            topic_prefix=f"bench{tag}.",
            instance_id="bench-driver",
            redis_url=args.redis,
            redis_prefix=f"bench:{tag}:",
            **stack_settings(args),
        )
        await ensure_topics(bootstrap, topics_of(settings).specs())
        followers = Followers(settings)
        followers.start()
        try:
            if not await followers.wait(
                lambda: {a.role for a in followers.log if a.state == "ready"} == set(ROLES),
                STARTUP_TIMEOUT_S,
            ):
                raise RuntimeError("the follower processes did not start")
            return await with_controller(args, settings, followers, workdir / "controller.log")
        finally:
            followers.stop()


async def with_controller(
    args: argparse.Namespace, settings: CommonSettings, followers: Followers, log: Path
) -> Samples:
    controller = spawn_controller(
        settings, args.tick, args.time_scale, log, env=controller_env(args, settings)
    )
    producer = make_producer(settings)
    await producer.start()
    worker = FakeWorker(
        producer, topics_of(settings).telemetry, SAMPLE_PERIODS_PER_SCALE * args.time_scale
    )
    reporting = asyncio.create_task(worker.run())
    measuring = asyncio.create_task(
        measure(
            settings,
            followers,
            worker,
            producer,
            args.trials,
            args.warmup,
            args.pings,
            args.idle_trials,
            args.idle_s,
        )
    )
    try:
        await asyncio.wait({reporting, measuring}, return_when=asyncio.FIRST_COMPLETED)
        if not measuring.done():
            await reporting  # it failed: raise its error
        return measuring.result()
    except RuntimeError as e:
        tail = (await asyncio.to_thread(log.read_text, errors="replace"))[-3000:]
        raise RuntimeError(f"{e}\n-- controller log --\n{tail}") from e
    finally:
        for task in (reporting, measuring):
            task.cancel()
        await asyncio.gather(reporting, measuring, return_exceptions=True)
        await producer.stop()
        stop_controller(controller)


# -- report -------------------------------------------------------------------------------
def plot(samples: Samples, tick_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = [
        *((f"reaction at {r}", samples.reaction[r], "-") for r in ROLES),
        *((f"baseline: broker round trip to {r}", samples.baseline[r], ":") for r in ROLES),
        *((f"after idle, at {r}", samples.after_idle[r], "--") for r in ROLES),
    ]
    for label, values, style in series:
        if values:
            xs = sorted(values)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, style, where="post", label=f"{label} (n={len(xs)})")
    ax.axvline(tick_s * 1000, color="grey", linewidth=0.8, label=f"controller tick {tick_s:g}s")
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds (log)")
    ax.set_ylabel("fraction of trials")
    ax.set_title("Telemetry past a threshold → control event applied (CDF)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=35, help="measured trials")
    parser.add_argument("--warmup", type=int, default=2, help="trials run first, not counted")
    parser.add_argument("--pings", type=int, default=2, help="baseline pings per trial")
    parser.add_argument("--tick", type=float, default=0.05, help="SEAWALL_CONTROLLER_TICK_S")
    parser.add_argument(
        "--idle-trials", type=int, default=3, help="trials after a silence, measured last"
    )
    parser.add_argument(
        "--idle-s", type=float, default=60.0, help="the silence before each idle trial"
    )
    parser.add_argument(
        "--time-scale", type=float, default=0.01, help="SEAWALL_CONTROLLER_TIME_SCALE"
    )
    parser.add_argument(
        "--as-seawall-up",
        action="store_true",
        help="the settings seawall up gives the embedded broker: the doorbell (Redis "
        "pub/sub), the 10 ms busy fetch wait, the controller's 250 ms telemetry wait",
    )
    parser.add_argument(
        "--redis", default=os.environ.get("SEAWALL_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    args = parser.parse_args()

    load_before = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="seawall-reaction-") as tmp:
        samples = asyncio.run(run(args, Path(tmp)))
    elapsed = time.monotonic() - started

    reaction = {r: summary(samples.reaction[r]) for r in ROLES}
    decision = {r: summary(samples.to_decision[r]) for r in ROLES}
    baseline = {r: summary(samples.baseline[r]) for r in ROLES}
    after_idle = {r: summary(samples.after_idle[r]) for r in ROLES}
    ratios = {
        r: {q: ratio(reaction[r][q], baseline[r][q]) for q in ("p50", "p99", "max")} for r in ROLES
    }
    print(f"{'at':<10}{'measured':<22}{'n':>4}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for role in ROLES:
        rows = (
            ("reaction", reaction[role]),
            ("  t0 → decision", decision[role]),
            (f"after {args.idle_s:g}s idle", after_idle[role]),
            ("baseline", baseline[role]),
        )
        for name, row in rows:
            cells = "".join(f"{fmt(row[q], '.1f'):>10}" for q in ("p50", "p99", "max"))
            print(f"{role:<10}{name:<22}{row['n']:>4}{cells}")
        cells = "".join(f"{fmt(ratios[role][q], '.1f') + 'x':>10}" for q in ("p50", "p99", "max"))
        print(f"{role:<10}{'reaction / baseline':<22}{'':>4}{cells}")
    missed = {r: n for r, n in samples.missed.items() if n}
    if missed:
        print(f"missed (no reaction within {REACTION_TIMEOUT_S:g}s): {missed}")
    print(f"tick {args.tick:g}s, time scale {args.time_scale:g}, {elapsed:.0f}s in all")

    RESULTS.mkdir(exist_ok=True)
    doc = {
        "benchmark": "reaction",
        "commit": commit(),
        "unit": "milliseconds",
        "measures": (
            "t0: the broker acked the first telemetry record past a threshold; "
            "t1: ControlFollower.on_change fired for the resulting control event"
        ),
        "followers": (
            "ControlFollower (as Admission and Worker construct it), one process per role; "
            "not the full Admission and Worker components"
        ),
        "controller": "python -m services.controller (its own process)",
        "triggers": {
            "admission": "GpuStats 95 °C → DegradationLevel 3 on pool:main",
            "worker": "GpuStats with the memory headroom used → BreakerState open, level 4, "
            "on worker:bench-w1 (same record)",
        },
        "baseline": "a control event produced to the control topic → the same followers' "
        "on_change (the broker round trip)",
        "settings": {
            "controller_tick_s": args.tick,
            "controller_time_scale": args.time_scale,
            "telemetry_period_s": SAMPLE_PERIODS_PER_SCALE * args.time_scale,
            "trials": args.trials,
            "warmup_trials": args.warmup,
            "pings_per_trial": args.pings,
            "idle_trials": args.idle_trials,
            "idle_s": args.idle_s,
            "as_seawall_up": args.as_seawall_up,
            "stack": stack_settings(args)
            | {"controller_fetch_max_wait_ms": embedded.CONTROLLER_FETCH_WAIT_MS}
            if args.as_seawall_up
            else {"consumer_fetch_max_wait_ms": 50},
        },
        "machine": machine(load_before, broker=EMBEDDED_BROKER),
        "elapsed_s": elapsed,
        "admission_p99_ms": reaction["admission"]["p99"],
        "round_trip_p99_ms": baseline["admission"]["p99"],
        "after_idle_p99_ms": after_idle["admission"]["p99"],
        "results": {
            "reaction": reaction,
            "after_idle": after_idle,
            "baseline": baseline,
            "missed": samples.missed,
            "t0_to_decision": decision,
        },
        "produce_ack_ms": summary(samples.produce_ack_ms),
        "ratios_vs_baseline": ratios,
        "samples_ms": {
            "reaction": samples.reaction,
            "after_idle": samples.after_idle,
            "baseline": samples.baseline,
        },
    }
    (RESULTS / "reaction.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(samples, args.tick, RESULTS / "reaction.png")
    print(f"wrote {RESULTS / 'reaction.json'} and {RESULTS / 'reaction.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
