"""Admission throughput: decisions per second of one admission process, and the latency it
adds at half that rate, through the real broker and the real Redis.

One admission process (``python -m services.admission``, started as ``seawall up`` starts
it) on the embedded broker (Tansu, started on a free port and stopped at the end) and the
local Redis, under a topic prefix and a Redis prefix of its own (its keys are deleted at
the end). Requests come from twelve tenants, four per tier, each on its tier's priority
topic (basic → bulk, pro → standard, enterprise → vip), for both pools (enterprise always
to ``main``), with a ~110-token prompt; every tier's quota is set so high (``SEAWALL_QUOTA_*``)
that every request is admitted: each decision is the full path (screen, the quota charge
— a batch's charges in a few calls of the bucket script, one round trip — the token
reservation, placement on a worker, the abort check, the dispatch).

Pacing. Admission dispatches only into free pool slots (``capacity.py``). This script
plays ``--workers-per-pool`` fake workers per pool (4), each heartbeating every ``BEAT_S`` s as
``serving`` with the largest batch limit the schema allows (65 536) and nothing in
flight, so that the slots (and the ledger of dispatched requests, which no completion
empties here) never bind. Each reports the dispatch partitions a consumer group would
assign it (round robin: partition ``p`` to worker ``p mod --workers-per-pool``; with 3
partitions and 4 workers, one owns none), as real workers do, so that admission places
every request on a worker (``policy/round_budget.py``); the requests carry no session
(the usual request over HTTP), so each is placed on the least loaded worker. No worker
consumes the dispatch topics; no ``RequestCompleted`` is sent, so the corrections loop
stays idle.

1. *Throughput.* ``N`` requests are produced (and acked) on the priority topics before
   admission starts; it then joins its group and works through them. Decisions per second
   = ``(N − 1) / (last − first dispatch)``, from the dispatch records' timestamps (the
   producer's ``CreateTime``: when admission handed each to its producer), so the start-up
   and the group join are not counted.
2. *Latency.* An open loop at half that rate for ``--duration`` s: each request is sent at
   its scheduled time, whatever the earlier ones did. Per request, ``t0`` = the broker acked
   it on its priority topic, ``t1`` = this process received its dispatch record on the
   dispatch topic (a groupless consumer with the services' consumer settings). Also kept:
   ``t0`` → the dispatch record's ``CreateTime`` (the part inside admission, its fetch
   included; 1 ms resolution).

Who used the CPUs. On 2 cores admission competes with the broker, Redis, this process
(the load: producer and consumer) and anything else running. For each phase the JSON
keeps the cores used by the machine, admission, the broker, this process and the rest
(``others``: Redis and the other processes; coarse over a window as short as the
relay's, about a second), and admission's CPU time per decision. The
throughput figure also comes as the rate over the middle 80 % of the records, a check
that no burst at either end makes it.

Baselines, same broker, same run, same record bytes:

- *relay*: the same ``N`` records preloaded on a plain topic and moved by a bare
  consume → produce loop (``getmany`` of admission's ``intake_batch``, send all, await the
  acks; in this process) to another topic; records per second measured as for admission.
  Admission's figure against it is what its decisions cost over moving records.
- *hop*: an open loop at the same rate on a plain topic, read back by the same kind of
  consumer: the bare broker hop ``t0`` → ``t1``. Admission's latency against it is what
  admission adds over one plain hop (admission's path is two: request → it → dispatch).
- *two hops*: the same open loop through a bare forwarding relay in a process of its own
  (``forward``: reads as admission's intake reads, sends as its dispatch loop sends,
  without waiting for the acks): the two hops admission's path has, without its
  decisions. Admission's latency against it is what the decisions add. (Its CPU counts
  under ``others``.)

Every consumer — admission's, and this script's reading the dispatch and hop topics —
fetches as ``seawall up`` has them fetch on the embedded broker: a 10 ms wait while
records flow, 50 ms otherwise (``seawall_client.fetch_pacing``); ``--busy-wait-ms 0``
runs them at 50 ms throughout, as every run before this option did.

What would skew the latencies, kept out:

- The embedded broker's fetch costs more the more batches a partition holds (Tansu
  0.6.0's memory storage lists every batch of the partition for each fetch that
  returns records, and never deletes one), so a hop slows down as its topic fills:
  within every phase alike, and across phases where one reads what another wrote. Each
  latency phase reads topics no earlier phase wrote. (Until 2026-12-07 the two-hop
  phase's relay wrote into the one-hop phase's topic: 65-96 ms at p50 there against
  21 ms on a fresh topic, in the same harness.) Within a phase its own topics fill: a
  plain hop's p99 grew from 7 to 177 ms over one 15 s loop. So each loop's latencies
  are also given per second (``latency_by_second_ms``, the plot's third panel), and
  each second's p99 against the baselines' in the same second of theirs.
- This process is the load generator and the stopwatch, and it holds every request
  and timestamp of the run: its full garbage collections stopped it for 90-160 ms
  every few seconds of an open loop. None runs while a phase is timed
  (``_common.steady_clock_hand``); admission runs with the interpreter's defaults.

Usage: ``python bench/admission_throughput.py [--requests 20000] [--duration 15]
[--busy-wait-ms 10] [--workers-per-pool 4] [--quick]`` (``--quick``: 2 000 requests, a
3 s open loop).
Writes ``bench/results/admission_throughput.json`` and ``.png``; prints ratios against the
baselines measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import psutil
import redis.asyncio as aioredis
from _common import (
    EMBEDDED_BROKER,
    commit,
    control_keys,
    embedded_broker,
    fmt,
    machine,
    output_dir,
    ratio,
    sampling_secret,
    steady_clock_hand,
    summary,
    worker_mac,
)
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import (
    TIER_PRIORITY,
    InferenceRequest,
    Priority,
    SamplingParams,
    Tier,
    WorkerHeartbeat,
)
from seawall.embedded import FETCH_BUSY_WAIT_MS
from seawall.procs import ChildProcess
from seawall_client.kafka import ensure_topics
from seawall_client.serde import encode
from seawall_client.topics import Topics, TopicSpec
from services.admission.settings import AdmissionSettings
from services.common.bus import Outgoing, make_consumer, make_producer, send_batched, topics_of
from services.common.hop_signing import load_key
from services.common.settings import DEFAULT_REDIS_URL, CommonSettings
from services.common.tokenizer import count_tokens

POOLS = ("main", "small")
TENANTS: tuple[tuple[str, Tier], ...] = tuple(
    (f"bench-{tier.value}-{i}", tier) for tier in Tier for i in range(4)
)
PROMPT = " ".join(
    f"Summarise paragraph {i} of the quarterly report in two sentences, keeping the figures."
    for i in range(5)
)
PROMPT_TOKENS = count_tokens(PROMPT)
"""About 110 tokens: what admission reserves is prompt + max_tokens. Counted once, as
ingress counts each request's prompt and writes the figure on its priority record."""
MAX_TOKENS = 128
ROOMY = json.dumps(
    {"requests": {"capacity": 1e9, "rate": 1e9}, "tokens": {"capacity": 1e12, "rate": 1e12}}
)
"""Every tier's quota: nothing is refused (the bucket still decides, and writes)."""
WORKER_SLOTS = 65_536
"""The largest ``batch_limit`` a worker may report (``schemas.telemetry``)."""
WORKERS_PER_POOL = 4
"""The default of ``--workers-per-pool``."""
BEAT_S = 0.5
THROUGHPUT_TIMEOUT_S = 180.0
SAMPLE_S = 0.25
"""How often the admission process's progress and CPU time are read."""
DRAIN_TIMEOUT_S = 20.0
"""How long the open loop waits, after its last send, for the last dispatch records."""


# -- the pieces around admission ----------------------------------------------------------
def request_bytes(index: int, run: str, topics: Topics, reply_to: str) -> tuple[str, bytes, bytes]:
    """Request ``index``: its priority topic, its key (the request id, which its dispatch
    record carries too: it has no session) and its encoded value."""
    tenant, tier = TENANTS[index % len(TENANTS)]
    rid = f"{run}-{index}"
    priority = TIER_PRIORITY[tier]
    request = InferenceRequest(
        request_id=rid,
        tenant=tenant,
        tier=tier,
        priority=priority,
        pool=POOLS[(index // len(TENANTS)) % len(POOLS)],
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=MAX_TOKENS),
        reply_to=reply_to,
        created_at=time.time(),
        prompt_tokens=PROMPT_TOKENS,
    )
    return topics.requests(priority), rid.encode(), encode(request)


async def fake_workers(
    producer: AIOKafkaProducer, topic: str, per_pool: int, partitions: int
) -> None:
    """Heartbeats of ``per_pool`` idle workers per pool with the largest batch limit, every
    ``BEAT_S`` s, each owning the dispatch partitions a round-robin assignment of
    ``partitions`` would give it."""
    started = time.time()
    while True:
        for pool in POOLS:
            for i in range(per_pool):
                worker = f"bench-{pool}-{i}"
                owned = tuple(p for p in range(partitions) if p % per_pool == i)
                beat = WorkerHeartbeat(
                    worker_id=worker,
                    pool=pool,
                    engine="fake",
                    status="serving",
                    in_flight=0,
                    batch_limit=WORKER_SLOTS,
                    host_cpu_pct=1.0,
                    host_memory_pct=1.0,
                    started_at=started,
                    at=time.time(),
                    partitions=owned,
                )
                value = encode(beat)
                await producer.send(
                    topic, value, key=worker.encode(), headers=worker_mac(topic, value)
                )
        await asyncio.sleep(BEAT_S)


def spawn_admission(settings: CommonSettings, log: Path) -> ChildProcess:
    """Admission with ``settings``' broker, Redis and prefixes (and its fetch pacing,
    as ``seawall up`` gives it on the embedded broker), none of this environment's."""
    busy = settings.consumer_fetch_busy_wait_ms
    env = {
        "SEAWALL_ENV_FILE": os.devnull,
        "SEAWALL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "SEAWALL_KAFKA_IDEMPOTENCE": "false",
        "SEAWALL_REDIS_URL": settings.redis_url,
        "SEAWALL_REDIS_PREFIX": settings.redis_prefix,
        "SEAWALL_TOPIC_PREFIX": settings.topic_prefix,
        "SEAWALL_TOPIC_PARTITIONS": str(settings.topic_partitions),
        "SEAWALL_POOLS": ",".join(POOLS),
        "SEAWALL_INSTANCE_ID": "bench-admission",
        "SEAWALL_CONTROL_KEYS_DIR": str(settings.control_keys_dir or control_keys()),
        "SEAWALL_SAMPLING_SECRET_FILE": str(settings.sampling_secret_file or sampling_secret()),
        "SEAWALL_LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
        **{f"SEAWALL_QUOTA_{tier.value.upper()}": ROOMY for tier in Tier},
        **({} if busy is None else {"SEAWALL_CONSUMER_FETCH_BUSY_WAIT_MS": str(busy)}),
    }
    proc = ChildProcess("admission", [sys.executable, "-m", "services.admission"], log, env)
    proc.start()
    return proc


@contextlib.asynccontextmanager
async def reading(
    settings: CommonSettings, topics: Sequence[str], *, from_start: bool
) -> AsyncIterator[AIOKafkaConsumer]:
    """A groupless consumer on every partition of ``topics``, positioned at their start or
    (resolved before this yields) their end."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        await consumer.topics()
        tps = [
            TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t))
        ]
        consumer.assign(tps)
        if from_start:
            await consumer.seek_to_beginning(*tps)
        else:
            await consumer.seek_to_end(*tps)
            for tp in tps:
                await consumer.position(tp)
        yield consumer
    finally:
        await consumer.stop()


async def committed(consumer: AIOKafkaConsumer, tps: Sequence[TopicPartition]) -> int:
    """Offsets the consumer's group committed on ``tps``, summed: on fresh topics, the
    records the group finished. (Tansu's end offsets cannot count records: they lag
    behind the last multi-record batch of a partition.)"""
    found: list[int | None] = [await consumer.committed(tp) for tp in tps]
    return sum(o or 0 for o in found)


async def read_all(settings: CommonSettings, topics: Sequence[str], quiet_s: float = 1.0) -> int:
    """The records on ``topics``, counted by reading them until none came for ``quiet_s``."""
    n = 0
    async with reading(settings, topics, from_start=True) as consumer:
        while batches := await consumer.getmany(timeout_ms=int(quiet_s * 1000)):
            n += sum(len(records) for records in batches.values())
    return n


async def timestamps(settings: CommonSettings, topics: Sequence[str], n: int) -> list[int]:
    """The ``CreateTime`` (ms) of the first ``n`` records on ``topics``."""
    out: list[int] = []
    async with reading(settings, topics, from_start=True) as consumer:
        while len(out) < n:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                out += [r.timestamp for r in records]
    return out


def per_second(stamps_ms: list[int]) -> float:
    return (len(stamps_ms) - 1) / ((max(stamps_ms) - min(stamps_ms)) / 1000)


def middle_per_second(stamps_ms: list[int]) -> float:
    """The rate between the 10th and the 90th percentile record: a check that the full
    window's rate is not made by a burst at either end."""
    ordered = sorted(stamps_ms)
    lo, hi = len(ordered) // 10, len(ordered) * 9 // 10
    return (hi - lo) / ((ordered[hi] - ordered[lo]) / 1000)


async def produce_all(
    producer: AIOKafkaProducer, items: Sequence[tuple[str, bytes, bytes]]
) -> float:
    """Produce everything as fast as the producer batches it, each record with the MAC
    ingress gives it (admission skips a request without: ``services.common.hop_signing``;
    made before the clock starts); records per second acked."""
    hop = load_key(control_keys(), "requests")
    signed = [(topic, key, value, hop.headers(topic, value)) for topic, key, value in items]
    started = time.perf_counter()
    futures = [
        await producer.send(topic, value, key=key, headers=headers)
        for topic, key, value, headers in signed
    ]
    await asyncio.gather(*futures)
    return len(items) / (time.perf_counter() - started)


async def relay(settings: CommonSettings, src: str, dst: str, n: int, batch: int) -> None:
    """The bare consume → produce loop: ``n`` records of ``src`` copied to ``dst``."""
    producer = make_producer(settings)
    await producer.start()
    try:
        async with reading(settings, [src], from_start=True) as consumer:
            moved = 0
            while moved < n:
                batches = await consumer.getmany(timeout_ms=100, max_records=batch)
                futures = [
                    await producer.send(dst, r.value, key=r.key)
                    for records in batches.values()
                    for r in records
                ]
                for future in futures:
                    await future
                moved += len(futures)
    finally:
        await producer.stop()


FORWARD_IN_FLIGHT = 4
"""Batches the forwarding relay may have unacknowledged at once (admission's dispatch
loop: ``dispatcher.ROUNDS_IN_FLIGHT``)."""


def _forward_main(
    settings: dict[str, Any], src: str, dst: str, batch: int, ready: Event, stop: Event
) -> None:
    asyncio.run(forward(CommonSettings(_env_file=None, **settings), src, dst, batch, ready, stop))


async def forward(
    settings: CommonSettings, src: str, dst: str, batch: int, ready: Event, stop: Event
) -> None:
    """The middle of the two-hop baseline, in a process of its own as admission is: what
    lands on ``src`` from now on, read as admission's intake reads (``getmany`` of its
    batch) and handed to the producer as its dispatch loop hands a round
    (``bus.send_batched``), without waiting for the acks, up to ``FORWARD_IN_FLIGHT``
    batches ahead."""
    producer = make_producer(settings)
    await producer.start()
    pending: deque[list[asyncio.Future[Any]]] = deque()
    try:
        async with reading(settings, [src], from_start=False) as consumer:
            ready.set()
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=100, max_records=batch)
                sent = await send_batched(
                    producer,
                    [
                        Outgoing(dst, r.value, r.key)
                        for records in batches.values()
                        for r in records
                        if r.value is not None and r.key is not None
                    ],
                )
                if sent:
                    pending.append(sent)
                if len(pending) > FORWARD_IN_FLIGHT:
                    await asyncio.gather(*pending.popleft())
    finally:
        await producer.stop()  # sends what is still pending


@asynccontextmanager
async def forwarding(settings: CommonSettings, src: str, dst: str) -> AsyncIterator[None]:
    """``forward`` running in a spawned process while the block runs."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    batch = AdmissionSettings(_env_file=None).intake_batch
    proc = ctx.Process(
        target=_forward_main,
        args=(settings.model_dump(), src, dst, batch, ready, stop),
        name="bench-forward",
    )
    proc.start()
    try:
        if not await asyncio.to_thread(ready.wait, 60):
            raise RuntimeError("the forwarding relay did not start")
        yield
    finally:
        stop.set()
        await asyncio.to_thread(proc.join, 30)
        if proc.is_alive():
            proc.kill()


@dataclass(frozen=True)
class Usage:
    """CPU seconds used so far, read at ``at`` (``time.time()``): by the whole machine
    (all its cores) and by each process of this benchmark."""

    at: float
    machine: float
    admission: float
    broker: float
    benchmark: float


def _cpu(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    times = proc.cpu_times()
    return float(times.user + times.system)


class CpuMeter:
    """Reads ``Usage``: on 2 cores the benchmark's own producer and consumer, the broker,
    Redis and whatever else runs compete with admission, so each figure comes with who
    used the CPUs meanwhile."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._broker = next(
            (p for p in self._me.children(recursive=True) if p.name().startswith("tansu")), None
        )
        self.admission: psutil.Process | None = None

    def read(self) -> Usage:
        c = psutil.cpu_times()
        idle = sum(getattr(c, f, 0.0) for f in ("idle", "iowait", "guest", "guest_nice"))
        return Usage(
            time.time(),
            sum(c) - idle,
            _cpu(self.admission),
            _cpu(self._broker),
            _cpu(self._me),
        )


def cores(a: Usage, b: Usage) -> dict[str, float]:
    """Cores used between two readings, per user; ``others``: the machine less ours."""
    wall = b.at - a.at
    used = {
        "machine": (b.machine - a.machine) / wall,
        "admission": (b.admission - a.admission) / wall,
        "broker": (b.broker - a.broker) / wall,
        "benchmark": (b.benchmark - a.benchmark) / wall,
    }
    used["others"] = max(0.0, used["machine"] - used["admission"] - used["broker"])
    used["others"] = max(0.0, used["others"] - used["benchmark"])
    return used


async def until_finished(
    settings: CommonSettings, topics: Topics, admission: ChildProcess, meter: CpuMeter, n: int
) -> list[Usage]:
    """Wait until admission finished ``n`` requests (dispatched, acked, committed);
    returns the CPU usage read every ``SAMPLE_S`` meanwhile.

    The group's committed offsets are read by a consumer of admission's group that never
    joins it."""
    watcher = make_consumer(settings, group_id=f"{settings.topic_prefix}seawall.admission")
    await watcher.start()
    started = time.monotonic()
    samples: list[Usage] = []
    try:
        await watcher.topics()
        tps = [
            TopicPartition(t, p)
            for t in (topics.requests(c) for c in Priority)
            for p in sorted(watcher.partitions_for_topic(t))
        ]
        while True:
            samples.append(meter.read())
            done = await committed(watcher, tps)
            if done >= n:
                return samples
            if not admission.alive:
                raise RuntimeError(f"admission exited:\n{admission.tail(40)}")
            if time.monotonic() - started > THROUGHPUT_TIMEOUT_S:
                raise RuntimeError(
                    f"admission finished {done} of {n} requests in "
                    f"{THROUGHPUT_TIMEOUT_S:.0f}s:\n{admission.tail(40)}"
                )
            await asyncio.sleep(SAMPLE_S)
    finally:
        await watcher.stop()


def around(samples: list[Usage], t0: float, t1: float) -> tuple[Usage, Usage]:
    """The last sample at or before ``t0`` and the first at or after ``t1``: the window,
    widened to the samples around it."""
    before = max((s for s in samples if s.at <= t0), key=lambda s: s.at, default=samples[0])
    after = min((s for s in samples if s.at >= t1), key=lambda s: s.at, default=samples[-1])
    return before, after


# -- the open loop -------------------------------------------------------------------------
@dataclass
class OpenLoop:
    """One open-loop run: per key, when the broker acked the request, when this process
    received the record it became, and that record's ``CreateTime``."""

    acked: dict[bytes, float] = field(default_factory=dict)
    received: dict[bytes, tuple[float, int]] = field(default_factory=dict)
    late_sends: int = 0
    """Sends more than 10 ms behind their schedule (the sender could not keep up)."""

    def latencies_ms(self) -> list[float]:
        return [
            (self.received[k][0] - t0) * 1000 for k, t0 in self.acked.items() if k in self.received
        ]

    def inside_ms(self) -> list[float]:
        return [
            self.received[k][1] - t0 * 1000 for k, t0 in self.acked.items() if k in self.received
        ]

    def by_second(self) -> list[dict[str, float | int | None]]:
        """The latencies of each whole second of the loop (by ``t0``, from the first), as
        ``summary`` gives them: the embedded broker slows down as the loop fills its
        topics, so a phase's percentiles mix its first seconds with its last."""
        if not self.acked:
            return []
        first = min(self.acked.values())
        seconds: dict[int, list[float]] = {}
        for k, t0 in self.acked.items():
            if k in self.received:
                seconds.setdefault(int(t0 - first), []).append((self.received[k][0] - t0) * 1000)
        whole = int(max(self.acked.values()) - first)  # the last, partial second left out
        return [{"second": i, **summary(seconds.get(i, []))} for i in range(whole)]


async def open_loop(
    settings: CommonSettings,
    producer: AIOKafkaProducer,
    items: Sequence[tuple[str, bytes, bytes]],
    rate: float,
    read_from: Sequence[str],
) -> OpenLoop:
    out = OpenLoop()
    expected = {key for _, key, _ in items}
    async with reading(settings, read_from, from_start=False) as consumer:
        with steady_clock_hand():

            async def receive() -> None:
                while not expected <= out.received.keys():
                    batches = await consumer.getmany(timeout_ms=100)
                    at = time.time()
                    for records in batches.values():
                        for r in records:
                            out.received[r.key] = (at, r.timestamp)

            def on_ack(key: bytes) -> Callable[[asyncio.Future[Any]], None]:
                def acked(future: asyncio.Future[Any]) -> None:
                    if not future.cancelled() and future.exception() is None:
                        out.acked[key] = time.time()

                return acked

            receiving = asyncio.create_task(receive())
            loop = asyncio.get_running_loop()
            start = loop.time()
            futures: list[asyncio.Future[Any]] = []
            for i, (topic, key, value) in enumerate(items):
                due = start + i / rate
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif delay < -0.01:
                    out.late_sends += 1
                future = await producer.send(topic, value, key=key)
                future.add_done_callback(on_ack(key))
                futures.append(future)
            await asyncio.gather(*futures)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(receiving, DRAIN_TIMEOUT_S)
            receiving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiving
    return out


# -- the run ---------------------------------------------------------------------------
@dataclass
class Figures:
    decisions_per_s: float = 0.0
    decisions_middle_per_s: float = 0.0
    relay_per_s: float = 0.0
    relay_middle_per_s: float = 0.0
    relay_cpu_us: float = 0.0
    """CPU time of this process per relayed record (it did nothing else meanwhile)."""
    throughput_cpu_us: float = 0.0
    """CPU time of the admission process per decision in the throughput window."""
    admission_cpu_us: float = 0.0
    """CPU time of the admission process per request during the open loop."""
    cores: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per phase (relay, throughput, open loop, hop, two hops): cores used, by whom."""
    preload_per_s: float = 0.0
    """How fast this process produced (and had acked) the preloaded requests."""
    rate: float = 0.0
    admission: OpenLoop = field(default_factory=OpenLoop)
    hop: OpenLoop = field(default_factory=OpenLoop)
    two_hops: OpenLoop = field(default_factory=OpenLoop)
    throughput_window_s: float = 0.0
    unanswered: dict[str, int] = field(default_factory=dict)
    """Records that should not exist: replies (rejections) and dead letters."""


async def run(args: argparse.Namespace, workdir: Path) -> Figures:
    async with embedded_broker(workdir) as bootstrap:
        tag = uuid.uuid4().hex[:8]
        settings = CommonSettings(
            _env_file=None,
            control_keys_dir=control_keys(),
            sampling_secret_file=sampling_secret(),
            kafka_bootstrap=bootstrap,
            kafka_idempotence=False,
            topic_prefix=f"bench{tag}.",
            pools=POOLS,
            redis_url=args.redis_url,
            redis_prefix=f"bench:{tag}:",
            instance_id="bench-driver",
            consumer_fetch_busy_wait_ms=args.busy_wait_ms or None,
        )
        try:
            return await measure(args, settings, workdir / "admission.log")
        finally:
            await forget_keys(settings)


async def forget_keys(settings: CommonSettings) -> None:
    client = aioredis.Redis.from_url(settings.redis_url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{settings.redis_prefix}*", count=1000)]
        for i in range(0, len(keys), 1000):
            await client.unlink(*keys[i : i + 1000])
    finally:
        await client.aclose()


async def measure(args: argparse.Namespace, settings: CommonSettings, log: Path) -> Figures:
    topics = topics_of(settings)
    prefix = settings.topic_prefix
    # Every phase reads a topic no earlier phase wrote (the module docstring).
    relay_in, relay_out, hop, hop_in, hop_out = (
        f"{prefix}bench.{n}" for n in ("relay-in", "relay-out", "hop", "hop-in", "hop-out")
    )
    n = settings.topic_partitions
    reply_to = topics.reply("bench")
    await ensure_topics(
        settings.kafka_bootstrap,
        [
            *topics.specs(),
            topics.reply_spec("bench"),
            *(TopicSpec(t, n) for t in (relay_in, relay_out, hop, hop_in, hop_out)),
        ],
    )
    out = Figures()
    producer = make_producer(settings)
    await producer.start()
    beating: asyncio.Task[None] | None = None
    admission: ChildProcess | None = None
    try:
        preload = [request_bytes(i, "pre", topics, reply_to) for i in range(args.requests)]
        meter = CpuMeter()
        # Baseline first, while nothing else runs: the same bytes, relayed.
        await measure_relay(settings, producer, preload, (relay_in, relay_out), meter, out)
        beating = asyncio.create_task(
            fake_workers(producer, topics.telemetry, args.workers_per_pool, n)
        )
        out.preload_per_s = await produce_all(producer, preload)
        admission = spawn_admission(settings, log)
        assert admission.pid is not None
        meter.admission = psutil.Process(admission.pid)
        await measure_throughput(settings, admission, meter, args.requests, out)

        out.rate = args.rate or out.decisions_per_s / 2
        count = int(out.rate * args.duration)
        if args.requests + count >= args.workers_per_pool * WORKER_SLOTS:
            raise RuntimeError("more requests than the fake workers' slots: --workers-per-pool")
        loop_items = [request_bytes(i, "open", topics, reply_to) for i in range(count)]
        dispatch = [topics.dispatch(p) for p in POOLS]
        before = meter.read()
        out.admission = await open_loop(settings, producer, loop_items, out.rate, dispatch)
        after = meter.read()
        out.admission_cpu_us = (after.admission - before.admission) / count * 1e6
        out.cores["open_loop"] = cores(before, after)
        hop_items = [(hop, k, v) for _, k, v in loop_items]
        out.hop = await open_loop(settings, producer, hop_items, out.rate, [hop])
        before = meter.read()
        out.cores["hop"] = cores(after, before)
        async with forwarding(settings, hop_in, hop_out):
            forwarded = [(hop_in, k, v) for _, k, v in loop_items]
            out.two_hops = await open_loop(settings, producer, forwarded, out.rate, [hop_out])
        out.cores["two_hops"] = cores(before, meter.read())

        out.unanswered = {
            "replies": await read_all(settings, [reply_to]),
            "dead_letters": await read_all(settings, [topics.deadletter]),
        }
        return out
    finally:
        if admission is not None:
            admission.stop(grace_s=30)
        if beating is not None:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
        await producer.stop()


async def measure_relay(
    settings: CommonSettings,
    producer: AIOKafkaProducer,
    preload: Sequence[tuple[str, bytes, bytes]],
    topics: tuple[str, str],
    meter: CpuMeter,
    out: Figures,
) -> None:
    src, dst = topics
    await produce_all(producer, [(src, k, v) for _, k, v in preload])
    batch = AdmissionSettings(_env_file=None).intake_batch
    cpu, before = time.process_time(), meter.read()
    with steady_clock_hand():  # the baseline as fast as this process can move records
        await relay(settings, src, dst, len(preload), batch)
    out.relay_cpu_us = (time.process_time() - cpu) / len(preload) * 1e6
    out.cores["relay"] = cores(before, meter.read())
    stamps = await timestamps(settings, [dst], len(preload))
    out.relay_per_s, out.relay_middle_per_s = per_second(stamps), middle_per_second(stamps)
    print(f"relay: {out.relay_per_s:.0f} records/s")


async def measure_throughput(
    settings: CommonSettings, admission: ChildProcess, meter: CpuMeter, n: int, out: Figures
) -> None:
    """Admission (just started) works through the ``n`` preloaded requests."""
    started = time.monotonic()
    topics = topics_of(settings)
    samples = await until_finished(settings, topics, admission, meter, n)
    stamps = await timestamps(settings, [topics.dispatch(p) for p in POOLS], n)
    out.decisions_per_s = per_second(stamps)
    out.decisions_middle_per_s = middle_per_second(stamps)
    out.throughput_window_s = (max(stamps) - min(stamps)) / 1000
    before, after = around(samples, min(stamps) / 1000, max(stamps) / 1000)
    out.throughput_cpu_us = (after.admission - before.admission) / n * 1e6
    out.cores["throughput"] = cores(before, after)
    print(
        f"admission: {out.decisions_per_s:.0f} decisions/s "
        f"({time.monotonic() - started:.1f}s with its start)"
    )


# -- report -------------------------------------------------------------------------------
def plot(
    figures: Figures, by_second: dict[str, list[dict[str, float | int | None]]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, third) = plt.subplots(1, 3, figsize=(16, 4.5), width_ratios=(1, 2, 2))
    names = ["admission\n(decisions)", "bare relay\n(records)"]
    values = [figures.decisions_per_s, figures.relay_per_s]
    bars = left.bar(names, values, color=["tab:blue", "tab:grey"])
    left.bar_label(bars, fmt="%.0f")
    left.set_ylabel("per second")
    left.set_title("Throughput, one process")
    series = [
        ("through admission (ack → dispatch received)", figures.admission.latencies_ms(), "-"),
        ("of which inside admission (ack → its send)", figures.admission.inside_ms(), "--"),
        ("baseline: one plain broker hop", figures.hop.latencies_ms(), ":"),
        ("two plain hops (a bare relay between)", figures.two_hops.latencies_ms(), "-."),
    ]
    for label, values_ms, style in series:
        if values_ms:
            xs = sorted(max(v, 0.1) for v in values_ms)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            right.step(xs, ys, style, where="post", label=f"{label} (n={len(xs)})")
    right.set_xscale("log")
    right.set_xlabel("milliseconds (log)")
    right.set_ylabel("fraction of requests")
    right.set_title(f"Latency at {figures.rate:.0f} requests/s (CDF)")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8, loc="upper left")
    for label, key, style in (
        ("through admission", "through_admission", "-"),
        ("one plain hop", "plain_hop", ":"),
        ("two plain hops", "two_plain_hops", "-."),
    ):
        seconds = [row for row in by_second[key] if row["p99"] is not None]
        third.plot([r["second"] for r in seconds], [r["p99"] for r in seconds], style, label=label)
    third.set_xlabel("second of the open loop")
    third.set_ylabel("p99 ms")
    third.set_title("p99 by second (the broker fills as a loop runs)")
    third.grid(True, alpha=0.3)
    third.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def redis_version(url: str) -> str:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return str(client.info("server")["redis_version"])
    finally:
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20_000, help="preloaded requests (N)")
    parser.add_argument("--duration", type=float, default=15.0, help="open-loop seconds")
    parser.add_argument(
        "--rate", type=float, default=None, help="open-loop rate (default: half the decisions/s)"
    )
    parser.add_argument(
        "--busy-wait-ms",
        type=int,
        default=FETCH_BUSY_WAIT_MS,
        help="every consumer's fetch wait while records flow, admission's and this "
        "script's alike (default: what `seawall up` sets on the embedded broker; 0: none, "
        "the 50 ms fetch wait throughout)",
    )
    parser.add_argument(
        "--workers-per-pool",
        type=int,
        default=WORKERS_PER_POOL,
        help="fake workers heartbeating per pool (a large fleet: what admission's rounds "
        "and its telemetry tail cost with it)",
    )
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--quick", action="store_true", help="a short trial run")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.duration = min(args.requests, 2_000), min(args.duration, 3.0)

    load_before = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="seawall-admission-bench-") as tmp:
        figures = asyncio.run(run(args, Path(tmp)))
    elapsed = time.monotonic() - started

    latency = {
        "through_admission": summary(figures.admission.latencies_ms()),
        "inside_admission": summary(figures.admission.inside_ms()),
        "plain_hop": summary(figures.hop.latencies_ms()),
        "two_plain_hops": summary(figures.two_hops.latencies_ms()),
    }
    lost = {
        name: len(run.acked) - len(run.latencies_ms())
        for name, run in (
            ("admission", figures.admission),
            ("hop", figures.hop),
            ("two_hops", figures.two_hops),
        )
    }
    throughput_ratio = ratio(figures.decisions_per_s, figures.relay_per_s)
    latency_ratios = {
        q: ratio(latency["through_admission"][q], latency["plain_hop"][q])
        for q in ("p50", "p99", "max")
    }
    two_hop_ratios = {
        q: ratio(latency["through_admission"][q], latency["two_plain_hops"][q])
        for q in ("p50", "p99", "max")
    }
    print(f"{'':<44}{'per s':>10}")
    print(f"{'admission decisions':<44}{figures.decisions_per_s:>10.0f}")
    print(f"{'baseline: bare relay, records':<44}{figures.relay_per_s:>10.0f}")
    print(f"{'admission / relay':<44}{fmt(throughput_ratio, '.2f') + 'x':>10}")
    print(
        f"(middle 80% of the records: admission {figures.decisions_middle_per_s:.0f}/s, "
        f"relay {figures.relay_middle_per_s:.0f}/s)"
    )
    print(f"(preload: {figures.preload_per_s:.0f} records/s produced and acked by one producer)")
    print(
        f"CPU per record: relay {figures.relay_cpu_us:.0f} µs; admission "
        f"{figures.throughput_cpu_us:.0f} µs per decision at full rate, "
        f"{figures.admission_cpu_us:.0f} µs in the open loop"
    )
    print(f"\nopen loop at {figures.rate:.0f} requests/s for {args.duration:g}s")
    print(f"{'':<44}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for name, row in (
        ("through admission (ack → dispatch received)", latency["through_admission"]),
        ("  inside admission (ack → its send)", latency["inside_admission"]),
        ("baseline: plain hop (ack → received)", latency["plain_hop"]),
        ("two plain hops (a bare relay between)", latency["two_plain_hops"]),
    ):
        cells = "".join(f"{fmt(row[q], '.1f'):>10}" for q in ("p50", "p99", "max"))
        print(f"{name:<44}{row['n']:>6}{cells}")
    for name, ratios in (
        ("through admission / plain hop", latency_ratios),
        ("through admission / two plain hops", two_hop_ratios),
    ):
        cells = "".join(f"{fmt(ratios[q], '.1f') + 'x':>10}" for q in ("p50", "p99", "max"))
        print(f"{name:<44}{'':>6}{cells}")
    by_second = {
        "through_admission": figures.admission.by_second(),
        "plain_hop": figures.hop.by_second(),
        "two_plain_hops": figures.two_hops.by_second(),
    }
    p99_by_second = [
        {
            "second": a["second"],
            "vs_plain_hop": ratio(a["p99"], h["p99"]),
            "vs_two_plain_hops": ratio(a["p99"], t["p99"]),
        }
        for a, h, t in zip(*by_second.values(), strict=False)
    ]
    print("\np99 ms by second of each open loop (its topics fill as it runs):")
    print(f"{'second':>6}{'admission':>11}{'one hop':>9}{'two hops':>10}{'/ one':>8}{'/ two':>8}")
    for a, h, t, r in zip(*by_second.values(), p99_by_second, strict=False):
        print(
            f"{a['second']:>6}{fmt(a['p99'], '.1f'):>11}{fmt(h['p99'], '.1f'):>9}"
            f"{fmt(t['p99'], '.1f'):>10}{fmt(r['vs_plain_hop'], '.1f') + 'x':>8}"
            f"{fmt(r['vs_two_plain_hops'], '.1f') + 'x':>8}"
        )
    if any(lost.values()) or any(figures.unanswered.values()):
        print(f"not received: {lost}; replies and dead letters: {figures.unanswered}")
    late = {
        "admission": figures.admission.late_sends,
        "hop": figures.hop.late_sends,
        "two_hops": figures.two_hops.late_sends,
    }
    if any(late.values()):
        print(f"sends more than 10 ms behind schedule: {late}")
    print(f"cores used (of {mp.cpu_count()}):")
    for phase, used in figures.cores.items():
        print(f"  {phase:<11}" + ", ".join(f"{who} {n:.2f}" for who, n in used.items()))
    print(f"load average at the start {load_before[0]:.2f}; {elapsed:.0f}s in all")

    out = output_dir("admission_throughput", args.quick)
    doc = {
        "benchmark": "admission_throughput",
        "commit": commit(),
        "measures": {
            "decisions_per_s": "(N - 1) / (last - first dispatch record CreateTime), N requests "
            "preloaded on the priority topics before admission started",
            "latency_ms": "open loop at half the decisions/s: t0 = broker ack of the request, "
            "t1 = this process received its dispatch record (groupless consumer)",
            "inside_admission_ms": "t0 -> the dispatch record's CreateTime (admission's send)",
            "latency_by_second_ms": "the same latencies per whole second of each open loop, "
            "by t0 (the embedded broker slows down as a loop fills its topics)",
        },
        "admission": "python -m services.admission (its own process), default settings but "
        "every tier's quota at 1e9 requests and 1e12 tokens (capacity and per second) and "
        "the fetch busy wait of settings.fetch_busy_wait_ms",
        "pacing": f"{args.workers_per_pool} fake workers per pool heartbeating every {BEAT_S}s as "
        f"serving, batch_limit {WORKER_SLOTS}, in_flight 0, owning the dispatch partitions "
        "a round-robin assignment gives them (admission places each request, which has "
        "no session, on a worker); no completions",
        "baselines": {
            "relay": "the same N records moved by a bare consume -> produce loop "
            "(getmany of intake_batch, send, await acks) in the benchmark process",
            "plain_hop": "open loop at the same rate on a plain topic, same consumer",
            "two_plain_hops": "the same open loop through a bare forwarding relay in its own "
            "process (getmany of intake_batch, bus.send_batched without awaiting acks, up to "
            f"{FORWARD_IN_FLIGHT} batches in flight): the hops admission's path has, "
            "without its decisions",
        },
        "timing": "each latency phase reads topics no earlier phase wrote; the benchmark "
        "process runs no cyclic garbage collection while the relay or an open loop is timed",
        "settings": {
            "requests": args.requests,
            "workers_per_pool": args.workers_per_pool,
            "open_loop_s": args.duration,
            "open_loop_rate_per_s": figures.rate,
            "tenants": len(TENANTS),
            "pools": POOLS,
            "max_tokens": MAX_TOKENS,
            "fetch_busy_wait_ms": args.busy_wait_ms or None,
            "quick": args.quick,
        },
        "machine": machine(
            load_before, broker=EMBEDDED_BROKER, redis=redis_version(args.redis_url)
        ),
        "elapsed_s": elapsed,
        # the figures issue 15 compares from run to run
        "decisions_per_s": figures.decisions_per_s,
        "relay_per_s": figures.relay_per_s,
        "latency_p99_ms": latency["through_admission"]["p99"],
        "plain_hop_p99_ms": latency["plain_hop"]["p99"],
        "two_hops_p99_ms": latency["two_plain_hops"]["p99"],
        "results": {
            "decisions_per_s": figures.decisions_per_s,
            "relay_records_per_s": figures.relay_per_s,
            "middle_80pct": {
                "decisions_per_s": figures.decisions_middle_per_s,
                "relay_records_per_s": figures.relay_middle_per_s,
            },
            "preload_produce_per_s": figures.preload_per_s,
            "cpu_us_per_record": {
                "relay": figures.relay_cpu_us,
                "admission_throughput": figures.throughput_cpu_us,
                "admission_open_loop": figures.admission_cpu_us,
            },
            "cores_used": figures.cores,
            "throughput_window_s": figures.throughput_window_s,
            "latency_ms": latency,
            "latency_by_second_ms": by_second,
            "not_received": lost,
            "late_sends": late,
            "replies_and_dead_letters": figures.unanswered,
        },
        "ratios": {
            "decisions_vs_relay": throughput_ratio,
            "latency_through_admission_vs_plain_hop": latency_ratios,
            "latency_through_admission_vs_two_plain_hops": two_hop_ratios,
            "p99_by_second": p99_by_second,
        },
    }
    (out / "admission_throughput.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(figures, by_second, out / "admission_throughput.png")
    print(f"wrote {out / 'admission_throughput.json'} and {out / 'admission_throughput.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
