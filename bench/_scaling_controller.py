"""Part 1 of the scaling benchmark: the controller against a fleet's telemetry.

On the embedded broker (Tansu, started on a free port and stopped at the end). Each phase
has a topic prefix of its own (fresh topics, a fresh consumer group) and runs:

- a *load generator* process (``_scaling_fleet``) playing ``W`` synthetic workers
  without engines, each sending a worker's ``WorkerReport`` every second (its readings
  and the summary of the requests it finished) to the telemetry topic, and one
  ``RequestCompleted`` per finished request to the completions topic,
  ``--requests-per-worker`` per second (default 13.2: the vLLM saturation of one GPU
  serving a 7B model that ``CALIBRATION.md`` cites: a busy fleet); its achieved send
  rates are measured and reported (*sent*: telemetry records, what the controller
  reads).
- the reader: either a *bare consumer* (one ``AIOKafkaConsumer`` with every partition
  assigned, reading and committing to its own group every second, nothing else: the
  baseline), or one or two *controller processes* (``python -m services.controller``, as
  ``seawall up`` runs it, default tick of 1 s, unscaled policy windows), each started
  fresh: what is measured is a controller meeting a running fleet.

Partitions. The controller's ``route`` agent reads ``llm.telemetry``, keyed by *pool* as
the workers key it, and decides each record on its pool's partition itself (anything
else would go through its internal topic ``<app id>-telemetry-by-pool`` to the
``decide`` agent); an instance owns whole pools. A second controller process can only take
over partitions, so the fleet has ``POOLS`` (6) pools, named so that they land on distinct
partitions of the internal topic, and every topic has ``PARTITIONS`` (6) partitions
(``SEAWALL_TOPIC_PARTITIONS``; the default 3 would split 2:1). Two controllers can then
split the routing and the pools 3:3; with a single pool a second one could take routing
only.

Measured per phase, for ``--duration`` s of load starting once every reader is in place
(the controllers' group stable with all its members):

- *lag*, every second: end offsets minus the group's committed offsets, summed over
  partitions, on the telemetry topic (the ``route`` stage) and on the internal topic (the
  ``decide`` stage); their sum is the *backlog*, records not yet decided. faust commits
  every 2.8 s, so a reader that keeps up shows a saw-tooth up to ~2.8 s of input.
  *Behind* = the backlog's lower envelope (its least value over the next 3 s) rises, over
  the last two thirds of the load, faster than 10 % of the send rate. Tansu quirk: its
  ``ListOffsets`` answers the last batch's base offset + 1, not the high watermark, so
  end offsets read low by less than one producer batch per partition.
- *decided*: records the ``decide`` agents took (``seawall_controller_telemetry_total``
  from each controller's ``/metrics``), as a rate over the last two thirds of the load;
  the longest evaluation of every pool (``seawall_controller_tick_seconds``); the CPU
  time of the reader processes and the share of the machine's cores busy.
- *reaction*: at 30, 45, 60 and 75 % of the load this process sends one ``GpuStats`` at
  95 °C for a worker of another pool each time (keyed by its pool, as workers key
  theirs: it queues behind that partition's backlog). The degradation ladder's hot rung
  trips on the window's maximum above 85 °C with no hold, so that pool's
  ``DegradationLevel`` 3 follows at the next tick. ``t0``: the broker acked the trigger;
  ``t1``: this process read the event on the control topic (a groupless consumer,
  ``fetch_max_wait_ms`` 20). A trigger not answered by the end of the load + ``GRACE_S``
  is *missed*, its wait kept as a lower bound. (Telemetry older than 30 s when the
  controller reads it is skipped as stale: a trigger behind a longer backlog is never
  answered.)
- *baseline*: the bare-consumer phase at the same scale. Its send rate is the reference
  for the rates at that scale (on 2 cores the generator competes for CPU); four control
  events produced straight to the control topic during it give the broker's round trip to
  the same reader under that load, the reference for reaction times.

Also, in this process: what the controller writes to its changelog at each scale's
workers per pool. A change writes the record of each scope it touched (the pool's, a
worker's) and waits for the broker's ack (a producer flush) before publishing the new
decision; the first sight of a worker writes that worker's record. Measured: the size of
a worker's record and of the pool's, the time to encode a worker's, and what first
seeing every worker of the pool writes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import statistics
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from queue import Empty
from typing import Any

import psutil
from _common import (
    HOT_TEMP_C,
    control_keys,
    gpu_stats,
    ratio,
    spawn_controller,
    stop_controller,
    summary,
    worker_mac,
)
from _scaling_fleet import (
    SAMPLE_S,
    Load,
    SyntheticWorker,
    generator_main,
    pool_names,
    pool_of,
    worker_id,
)
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client.parser import text_string_to_metric_families

from schemas import ControlEvent, DegradationLevel, Evidence
from seawall.embedded import free_port
from seawall_client.kafka import ensure_topics
from seawall_client.serde import CONTROL, TELEMETRY, DecodeError, decode, encode
from services.common.bus import make_consumer, make_producer, topics_of
from services.common.settings import CommonSettings
from services.controller.decider.pool import PoolDecider
from services.controller.settings import ControllerSettings

SCALES = (100, 1_000, 2_000, 5_000)
PARTITIONS = 6
POOLS = 6
TRIGGER_AT = (0.30, 0.45, 0.60, 0.75)
"""Fractions of the load window at which a trigger is sent (one pool each)."""
PINGS = 4
GRACE_S = 5.0
"""How long a phase waits after the load for triggers not yet answered."""
BARE_COMMIT_S = 1.0
FLOOR_SPAN_S = 3.0
"""The lag is judged on its lower envelope over this span (faust commits every 2.8 s)."""
BEHIND_SLOPE = 0.10
"""Behind: the lag grows faster than this share of the send rate."""
STARTUP_TIMEOUT_S = 120.0


# -- the bare consumer (the baseline's reader, its own process) ----------------------------
def _bare_main(load: Load, group: str, stop: Event, out: Queue[Any]) -> None:
    asyncio.run(_consume_bare(load, group, stop, out))


async def _consume_bare(load: Load, group: str, stop: Event, out: Queue[Any]) -> None:
    """Every partition assigned by hand (no group join to wait for); offsets committed to
    ``group`` every ``BARE_COMMIT_S``."""
    settings = CommonSettings(
        _env_file=None, kafka_bootstrap=load.bootstrap, instance_id="bench-bare-consumer"
    )
    consumer = make_consumer(settings, group_id=group, auto_offset_reset="latest")
    await consumer.start()
    read = 0
    try:
        tps = [TopicPartition(load.topic, p) for p in range(load.partitions)]
        consumer.assign(tps)
        for tp in tps:
            await consumer.position(tp)
        out.put(("ready", None))
        committed = time.monotonic()
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=200, max_records=10_000)
            read += sum(len(records) for records in batches.values())
            if time.monotonic() - committed >= BARE_COMMIT_S:
                await consumer.commit()
                committed = time.monotonic()
        await consumer.commit()
    finally:
        await consumer.stop()
        out.put(("done", read))


# -- probes in this process ---------------------------------------------------------------
class ControlWatch:
    """Reads the control topic from its end; resolves futures on matching events."""

    def __init__(self, settings: CommonSettings, topic: str) -> None:
        self._consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=20)
        self._tp = TopicPartition(topic, 0)
        self._wanted: dict[bytes, list[tuple[Callable[[ControlEvent], bool], asyncio.Future[Any]]]]
        self._wanted = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._consumer.start()
        self._consumer.assign([self._tp])
        await self._consumer.seek_to_end(self._tp)
        await self._consumer.position(self._tp)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._consumer.stop()

    def expect(
        self, key: str, match: Callable[[ControlEvent], bool]
    ) -> asyncio.Future[tuple[float, ControlEvent]]:
        """When (``time.time()``) the first matching event under ``key`` was read."""
        future: asyncio.Future[tuple[float, ControlEvent]] = (
            asyncio.get_running_loop().create_future()
        )
        self._wanted.setdefault(key.encode(), []).append((match, future))
        return future

    async def _run(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            at = time.time()
            for records in batches.values():
                for record in records:
                    waiting = self._wanted.get(record.key or b"")
                    if not waiting:
                        continue
                    try:
                        event = decode(CONTROL, record.value)
                    except DecodeError:
                        continue
                    for match, future in waiting:
                        if not future.done() and match(event):
                            future.set_result((at, event))


async def group_members(admin: AIOKafkaAdminClient, group: str) -> tuple[str, int]:
    """The group's state and its number of members."""
    (response,) = await admin.describe_consumer_groups([group])
    _error, _group, state, _ptype, _protocol, members = response.groups[0]
    return str(state), len(members)


async def wait_for_group(admin: AIOKafkaAdminClient, group: str, members: int) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # the group may not exist yet
            if await group_members(admin, group) == ("Stable", members):
                return
        await asyncio.sleep(0.25)
    raise RuntimeError(f"group {group} did not reach {members} stable members in time")


async def lag(
    consumer: AIOKafkaConsumer, admin: AIOKafkaAdminClient, group: str, tps: list[TopicPartition]
) -> int:
    """End offsets minus the group's committed offsets (none committed: 0, the topic is
    fresh and the group joined before the load)."""
    ends = await consumer.end_offsets(tps)
    committed = await admin.list_consumer_group_offsets(group, partitions=tps)
    return sum(
        max(0, ends[tp] - max(0, committed[tp].offset if tp in committed else 0)) for tp in tps
    )


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def busy_share(before: Any, after: Any) -> float:
    """The share of all cores not idle between two ``psutil.cpu_times()``."""
    total = sum(after) - sum(before)
    idle = (after.idle + after.iowait) - (before.idle + before.iowait)
    return 1.0 - idle / total if total > 0 else 0.0


SCRAPED = ("seawall_controller_telemetry_total", "seawall_controller_tick_seconds")
"""The only series ``scrape`` asks for (``name[]``): rendering all of them — four or five for
each of thousands of workers — every second cost the controller a tenth of its samples at
2,000 workers (py-spy), a load the benchmark would add and Prometheus, scraping every
15 s, would not."""


def scrape(port: int) -> tuple[float, float]:
    """A controller's telemetry records decided so far and its last tick's duration."""
    query = "&".join(f"name[]={name}" for name in SCRAPED)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?{query}", timeout=2) as page:
        text = page.read().decode()
    processed, tick = 0.0, 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "seawall_controller_telemetry":
            processed = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name == "seawall_controller_tick_seconds":
            tick = family.samples[0].value
    return processed, tick


async def receive(queue: Queue[Any], sender: BaseProcess, timeout_s: float) -> tuple[str, Any]:
    """The next message from a child process; raises if it died or said nothing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Empty):
            kind, detail = await asyncio.to_thread(queue.get, timeout=0.5)
            return str(kind), detail
        if not sender.is_alive():
            raise RuntimeError(f"{sender.name} exited (code {sender.exitcode})")
    raise RuntimeError(f"{sender.name} said nothing within {timeout_s:.0f}s")


# -- one phase ---------------------------------------------------------------------------
@dataclass
class Phase:
    workers: int
    controllers: int
    """0: the bare consumer (the baseline)."""
    offered_per_s: float
    startup_s: float = 0.0
    sent: int = 0
    sent_per_s: float = 0.0
    completions_per_s: float = 0.0
    """``RequestCompleted`` sent to the completions topic (the controller does not read
    them; the broker carries them)."""
    generator_cpu_s: float = 0.0
    duration_s: float = 0.0
    samples: list[dict[str, float]] = field(default_factory=list)
    """Per second: ``t`` (since the load began), ``lag``, ``processed``, ``tick_s``."""
    reactions: list[dict[str, Any]] = field(default_factory=list)
    pings_ms: list[float] = field(default_factory=list)
    bare_read: int | None = None
    readers_cpu_s: float = 0.0
    """CPU time of the consumer processes (controllers or the bare consumer) during the
    load."""
    machine_busy: float = 0.0
    """Share of all cores busy during the load (every process on the machine)."""
    exited: list[str] = field(default_factory=list)
    """Controllers that exited during the phase, with their logs' tails."""

    @property
    def label(self) -> str:
        if not self.controllers:
            return f"{self.workers} workers, bare consumer"
        return (
            f"{self.workers} workers, {self.controllers} controller{'s' * (self.controllers > 1)}"
        )


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None


def backlog(sample: dict[str, float]) -> float:
    """Records not yet decided: waiting on the telemetry topic (for ``route``) or on the
    internal topic (for ``decide``)."""
    return sample["lag"] + sample.get("lag_internal", 0.0)


def floor_of(samples: list[dict[str, float]], span_s: float) -> list[tuple[float, float]]:
    """The backlog's lower envelope: at each sample, the least backlog over the next
    ``span_s`` (longer than faust's commit interval: it holds the bottom of every
    saw-tooth)."""
    return [
        (s["t"], min(backlog(o) for o in samples if s["t"] <= o["t"] <= s["t"] + span_s))
        for s in samples
        if s["t"] + span_s <= samples[-1]["t"]
    ]


def analyse(phase: Phase) -> dict[str, Any]:
    """Rates and the lag trend over the last two thirds of the load window."""
    window = [s for s in phase.samples if phase.duration_s / 3 <= s["t"] <= phase.duration_s]
    loaded = [s for s in phase.samples if s["t"] <= phase.duration_s]
    envelope = [p for p in floor_of(loaded, FLOOR_SPAN_S) if p[0] >= phase.duration_s / 3]
    lag_slope = slope(envelope)
    processed = slope([(s["t"], s["processed"]) for s in window]) if phase.controllers else None
    last = window[-1] if window else None
    reacted = [r["reaction_ms"] for r in phase.reactions if r["reaction_ms"] is not None]
    missed = [r["waited_ms"] for r in phase.reactions if r["reaction_ms"] is None]
    ticks = [s["tick_s"] for s in window if s.get("tick_s") is not None]
    return {
        "label": phase.label,
        "workers": phase.workers,
        "controllers": phase.controllers,
        "offered_per_s": phase.offered_per_s,
        "sent_per_s": phase.sent_per_s,
        "completions_per_s": phase.completions_per_s,
        "sent_vs_offered": ratio(phase.sent_per_s, phase.offered_per_s),
        "generator_cpu_share": ratio(phase.generator_cpu_s, phase.duration_s),
        "processed_per_s": processed,
        "lag_end": last["lag"] if last else None,
        "lag_internal_end": last.get("lag_internal") if last else None,
        "backlog_end": backlog(last) if last else None,
        "backlog_end_s": ratio(backlog(last), phase.sent_per_s) if last else None,
        "backlog_slope_per_s": lag_slope,
        "backlog_slope_vs_sent": ratio(lag_slope, phase.sent_per_s),
        "behind": lag_slope is not None and lag_slope > BEHIND_SLOPE * phase.sent_per_s,
        "tick_s_max": max(ticks) if ticks else None,
        "readers_cpu_cores": ratio(phase.readers_cpu_s, phase.duration_s),
        "machine_busy": phase.machine_busy,
        "reaction_ms": summary(reacted),
        "reactions": len(reacted),
        "missed": len(missed),
        "missed_waited_ms_min": min(missed) if missed else None,
        "ping_ms": summary(phase.pings_ms),
        "startup_s": phase.startup_s,
        "controllers_exited": len(phase.exited),
    }


def record_cost(workers: int) -> dict[str, float]:
    """What the controller writes to its changelog for a pool of ``workers`` workers: the
    records of every scope (measured in this process, without load)."""
    now = time.time()
    decider = PoolDecider("bench-pool", ControllerSettings(_env_file=None).decider_config(), now)
    stamp = repr(now).encode()
    first_sight = 0
    for i in range(workers):
        report, _ = SyntheticWorker(i, ("bench-pool",), PARTITIONS, 0.0).round(stamp, 0.0)
        decider.observe(decode(TELEMETRY, report), now)
        changed = decider.take_records()
        first_sight += sum(len(encode(r)) for r in changed.workers.values() if r is not None)
        first_sight += len(encode(changed.pool)) if changed.pool is not None else 0
    records = decider.records()
    assert records.pool is not None
    worker = next(r for r in records.workers.values() if r is not None)
    rounds, started = 50, time.perf_counter()
    for _ in range(rounds):
        encode(worker)
    return {
        "workers_per_pool": workers,
        "worker_record_bytes": len(encode(worker)),
        "pool_record_bytes": len(encode(records.pool)),
        "encode_ms": (time.perf_counter() - started) / rounds * 1000,
        "first_sight_bytes": first_sight,
    }


@dataclass
class Rig:
    """What a phase measures with."""

    load: Load
    go: Event
    queue: Queue[Any]
    """The generator's messages."""
    generator: BaseProcess
    admin: AIOKafkaAdminClient
    ends: AIOKafkaConsumer
    """Groupless: reads the end offsets."""
    producer: AIOKafkaProducer
    """This process's: triggers and pings."""
    watch: ControlWatch
    group: str
    ports: list[int]
    """The controllers' metrics ports."""
    control: str
    internal: str
    """The controller's internal topic (keyed by pool); none for the bare consumer."""
    readers: list[int]
    """Pids of the reader processes."""


class Bench:
    def __init__(self, args: argparse.Namespace, bootstrap: str, workdir: Path) -> None:
        self.args = args
        self.bootstrap = bootstrap
        self.workdir = workdir
        self.pools = pool_names(POOLS, PARTITIONS)
        self.ctx = mp.get_context("spawn")

    def settings(self, prefix: str) -> CommonSettings:
        return CommonSettings(
            _env_file=None,
            control_keys_dir=control_keys(),
            kafka_bootstrap=self.bootstrap,
            kafka_idempotence=False,
            topic_prefix=prefix,
            topic_partitions=PARTITIONS,
            instance_id="bench-driver",
        )

    async def phase(self, workers: int, controllers: int) -> Phase:
        prefix = f"bench{uuid.uuid4().hex[:8]}."
        settings = self.settings(prefix)
        topics = topics_of(settings)
        await ensure_topics(self.bootstrap, topics.specs())
        duration = self.args.baseline_duration if controllers == 0 else self.args.duration
        load = Load(
            self.bootstrap,
            topics.telemetry,
            topics.completions,
            workers,
            self.pools,
            PARTITIONS,
            self.args.requests_per_worker,
            duration,
        )
        phase = Phase(workers, controllers, load.offered_per_s, duration_s=duration)
        queue: Queue[Any] = self.ctx.Queue()
        go, stop = self.ctx.Event(), self.ctx.Event()
        generator = self.ctx.Process(
            target=generator_main, args=(load, go, queue), name="generator"
        )
        ports = [free_port() for _ in range(controllers)]
        procs = [
            spawn_controller(
                settings,
                self.args.tick,
                1.0,
                self.workdir / f"controller-{prefix}{i}.log",
                instance_id=f"bench-controller-{i}",
                env={"SEAWALL_METRICS_PORT": str(port)},
            )
            for i, port in enumerate(ports)
        ]
        app_id = ControllerSettings(_env_file=None, topic_prefix=prefix).app_id
        group = app_id if controllers else f"{prefix}bench-bare"
        bare_queue: Queue[Any] = self.ctx.Queue()
        bare = (
            None
            if controllers
            else self.ctx.Process(
                target=_bare_main, args=(load, group, stop, bare_queue), name="bare-consumer"
            )
        )
        started = time.monotonic()
        generator.start()
        if bare is not None:
            bare.start()
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        ends = make_consumer(settings, group_id=None)
        producer = make_producer(settings)
        watch = ControlWatch(settings, topics.control)
        try:
            await admin.start()
            await ends.start()
            await producer.start()
            await watch.start()
            kind, detail = await receive(queue, generator, STARTUP_TIMEOUT_S)
            if kind != "ready":
                raise RuntimeError(f"the generator did not start: {detail}")
            if bare is not None:
                kind, detail = await receive(bare_queue, bare, STARTUP_TIMEOUT_S)
                if kind != "ready":
                    raise RuntimeError(f"the bare consumer did not start: {detail}")
            else:
                await wait_for_group(admin, group, controllers)
            phase.startup_s = time.monotonic() - started
            pids = [p.pid for p in procs] if bare is None else [bare.pid]
            rig = Rig(
                load=load,
                go=go,
                queue=queue,
                generator=generator,
                admin=admin,
                ends=ends,
                producer=producer,
                watch=watch,
                group=group,
                ports=ports,
                control=topics.control,
                internal=f"{app_id}-telemetry-by-pool" if controllers else "",
                readers=[pid for pid in pids if pid is not None],
            )
            await self._measure(phase, rig)
            for i, controller in enumerate(procs):
                if controller.poll() is not None:  # it died under the load: say so
                    log = self.workdir / f"controller-{prefix}{i}.log"
                    tail = log.read_text(errors="replace")[-2000:]
                    phase.exited.append(f"controller {i} exited {controller.returncode}: {tail}")
                    print(f"  WARNING: {phase.exited[-1]}", flush=True)
        finally:
            stop.set()
            go.set()
            await asyncio.gather(*(asyncio.to_thread(stop_controller, p, 15.0) for p in procs))
            if bare is not None:
                with contextlib.suppress(RuntimeError):
                    phase.bare_read = (await receive(bare_queue, bare, 10))[1]
                bare.join(timeout=10)
            generator.join(timeout=10)
            for proc in (generator, bare):
                if proc is not None and proc.is_alive():
                    proc.terminate()
            await watch.stop()
            await producer.stop()
            await ends.stop()
            with contextlib.suppress(Exception):  # frees the broker's memory, if it can
                await admin.delete_topics([s.name for s in topics.specs()])
            await admin.close()
        return phase

    async def _measure(self, phase: Phase, rig: Rig) -> None:
        load, watch, producer, ports = rig.load, rig.watch, rig.producer, rig.ports
        tps = [TopicPartition(load.topic, p) for p in range(PARTITIONS)]
        internal = [TopicPartition(rig.internal, p) for p in range(PARTITIONS)]
        rig.go.set()
        t_go = time.time()
        machine, reading = psutil.cpu_times(), cpu_seconds(rig.readers)

        async def sample() -> None:
            while True:
                at = time.time()
                point: dict[str, float] = {
                    "t": at - t_go,
                    "lag": await lag(rig.ends, rig.admin, rig.group, tps),
                }
                if rig.internal:
                    point["lag_internal"] = await lag(rig.ends, rig.admin, rig.group, internal)
                if ports:
                    scraped = await asyncio.gather(
                        *(asyncio.to_thread(scrape, port) for port in ports), return_exceptions=True
                    )
                    good = [s for s in scraped if isinstance(s, tuple)]
                    if len(good) == len(ports):
                        point["processed"] = sum(s[0] for s in good)
                        point["tick_s"] = max(s[1] for s in good)
                phase.samples.append(point)
                await asyncio.sleep(max(0.0, SAMPLE_S - (time.time() - at)))

        async def trigger(i: int) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, t_go + TRIGGER_AT[i] * load.duration_s - time.time()))
            worker = worker_id(i)  # worker i is in pool i (workers go round the pools)
            pool = pool_of(i, load.pools)
            seen = watch.expect(
                f"degradation/pool:{pool}",
                lambda e: isinstance(e, DegradationLevel) and e.level == 3,
            )
            hot = gpu_stats(worker, pool, time.time(), HOT_TEMP_C)
            value = encode(hot)
            await producer.send_and_wait(
                load.topic, value, key=pool.encode(), headers=worker_mac(load.topic, value)
            )
            t0 = time.time()
            timeout = t_go + load.duration_s + GRACE_S - t0
            try:
                at, event = await asyncio.wait_for(seen, max(0.1, timeout))
            except TimeoutError:
                return {"pool": pool, "reaction_ms": None, "waited_ms": (time.time() - t0) * 1000}
            return {
                "pool": pool,
                "reaction_ms": (at - t0) * 1000,
                "to_decision_ms": (event.issued_at - t0) * 1000,
                "waited_ms": (at - t0) * 1000,
            }

        async def ping(i: int) -> float | None:
            await asyncio.sleep(max(0.0, t_go + (i + 0.5) / PINGS * load.duration_s - time.time()))
            event = DegradationLevel(
                scope="pool:bench-ping",
                seq=i + 1,
                issued_at=time.time(),
                evidence=Evidence(reason="scaling benchmark baseline"),
                level=0,
            )
            seen = watch.expect(event.control_key, lambda e: e.seq == event.seq)
            await producer.send_and_wait(rig.control, encode(event), key=event.control_key.encode())
            t0 = time.time()
            try:
                at, _ = await asyncio.wait_for(seen, 10.0)
            except TimeoutError:
                return None
            return (at - t0) * 1000

        sampler = asyncio.create_task(sample())
        try:
            probes: list[asyncio.Task[Any]] = (
                [asyncio.create_task(trigger(i)) for i in range(len(TRIGGER_AT))]
                if phase.controllers
                else [asyncio.create_task(ping(i)) for i in range(PINGS)]
            )
            kind, stats = await receive(rig.queue, rig.generator, load.duration_s + 120)
            if kind != "done":
                raise RuntimeError(f"the generator failed: {stats}")
            phase.readers_cpu_s = cpu_seconds(rig.readers) - reading
            phase.machine_busy = busy_share(machine, psutil.cpu_times())
            results = await asyncio.gather(*probes)
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        phase.sent = stats["sent"]
        phase.sent_per_s = stats["sent"] / stats["elapsed_s"]
        phase.completions_per_s = stats["completions_sent"] / stats["elapsed_s"]
        phase.generator_cpu_s = stats["cpu_s"]
        phase.duration_s = stats["elapsed_s"]
        if phase.controllers:
            phase.reactions = results
        else:
            phase.pings_ms = [ms for ms in results if ms is not None]
