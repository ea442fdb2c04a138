"""The scaling benchmark's synthetic fleet: a load generator process playing ``W``
workers without engines.

Each worker sends what ``services/workers/service.py`` sends every
``telemetry_interval_s`` (1 s, the workers' default): one ``WorkerReport`` on the
telemetry topic — ``EngineStats``, one ``GpuStats`` (one GPU), its heartbeat and the
``RequestSummary`` of the requests it finished in the interval — and one
``RequestCompleted`` per finished request on the completions topic (which the
controller does not read; the broker carries them all the same),
``requests_per_worker_s`` per second. Workers are spread evenly over the interval and
keyed by pool, like real ones. The records are the workers' own models, encoded once
per worker with ``serde.encode`` and re-stamped per send (``at`` and the request id
replaced in the bytes), sent in per-partition batches from one producer: the generator
shares 2 cores with the broker and the controllers, so it spends as little as it can, and
its achieved send rate is measured and reported.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any

from _common import (
    HEALTHY_TEMP_C,
    completed,
    control_keys,
    engine_stats,
    gpu_stats,
    heartbeat,
    worker_mac,
)
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner

from schemas import WorkerReport
from seawall_client.serde import encode
from services.common.bus import make_producer
from services.common.settings import CommonSettings
from services.workers.policy.summary import RequestSummarizer
from services.workers.settings import WorkerSettings

SLOTS = 50
"""The telemetry interval is cut into this many slots; each worker sends in its own."""
TELEMETRY_INTERVAL_S: float = WorkerSettings.model_fields["telemetry_interval_s"].default
SAMPLE_S = 1.0
"""The lag is sampled this often; the generator notes its progress twice as often."""
MAX_PENDING_BATCHES = 500
SENTINEL_AT = 4_000_000_000.25
SENTINEL_AT_JSON = b"4000000000.25"
SENTINEL_ID = "bench-request-id-sentinel"
LATENCY_MS, TTFT_MS, PROMPT_TOKENS, COMPLETION_TOKENS = 900.0, 40.0, 230, 200
"""Every synthetic request: the same healthy figures."""


def partition_of(key: bytes, partitions: int) -> int:
    """The partition the producers' default partitioner picks for ``key``."""
    every = list(range(partitions))
    partition: int = DefaultPartitioner()(key, every, every)
    return partition


def pool_names(count: int, partitions: int) -> tuple[str, ...]:
    """``count`` pool names on distinct partitions (of the controller's topic keyed by
    pool), so that partitions shared among controllers share the pools too."""
    names: dict[int, str] = {}
    i = 0
    while len(names) < min(count, partitions):
        name = f"bench-pool-{i}"
        names.setdefault(partition_of(name.encode(), partitions), name)
        i += 1
    return tuple(names[p] for p in sorted(names))


def worker_id(index: int) -> str:
    return f"bench-w{index:05d}"


def pool_of(index: int, pools: Sequence[str]) -> str:
    return pools[index % len(pools)]


class SyntheticWorker:
    """One worker's telemetry, encoded once; ``round`` re-stamps it."""

    def __init__(self, index: int, pools: Sequence[str], partitions: int, requests: float) -> None:
        self.id = worker_id(index)
        pool = pool_of(index, pools)
        self.key = pool.encode()
        self.partition = partition_of(self.key, partitions)
        at = SENTINEL_AT
        self._reports = {
            n: encode(self._report(pool, at, n))
            for n in (math.floor(requests), math.ceil(requests))
        }
        self._completed = encode(
            completed(
                self.id,
                pool,
                at,
                SENTINEL_ID,
                ttft_ms=TTFT_MS,
                latency_ms=LATENCY_MS,
                prompt_tokens=PROMPT_TOKENS,
                completion_tokens=COMPLETION_TOKENS,
            )
        )
        if not all(SENTINEL_AT_JSON in t for t in (*self._reports.values(), self._completed)):
            raise RuntimeError("the timestamp is not encoded as expected")
        self._debt = random.random()
        self._served = 0

    def _report(self, pool: str, at: float, requests: int) -> WorkerReport:
        summary = RequestSummarizer(at - TELEMETRY_INTERVAL_S)
        for _ in range(requests):
            summary.add(LATENCY_MS, True, TTFT_MS, PROMPT_TOKENS, COMPLETION_TOKENS)
        return WorkerReport(
            worker_id=self.id,
            pool=pool,
            at=at,
            heartbeat=heartbeat(self.id, pool, at, in_flight=8, started_at=time.time()),
            engine=engine_stats(
                self.id, pool, at, in_flight=8, kv_cache_usage=0.4, kv_capacity_tokens=119_184
            ),
            gpus=(gpu_stats(self.id, pool, at, HEALTHY_TEMP_C),),
            requests=summary.take(at),
        )

    def round(self, stamp: bytes, requests: float) -> tuple[bytes, list[bytes]]:
        """One telemetry interval: the report, and the completions of the ``requests``
        it summarizes on average (the fraction carried over)."""
        self._debt += requests
        n = int(self._debt)
        self._debt -= n
        completions = []
        for _ in range(n):
            self._served += 1
            request_id = b"%s-%d" % (self.id.encode(), self._served)
            completions.append(
                self._completed.replace(SENTINEL_AT_JSON, stamp).replace(
                    SENTINEL_ID.encode(), request_id
                )
            )
        # the carried fraction stays in [0, 1): n is the floor or the ceiling of requests
        return self._reports[n].replace(SENTINEL_AT_JSON, stamp), completions


@dataclass(frozen=True)
class Load:
    bootstrap: str
    topic: str
    """The telemetry topic: what the controller reads, and what ``sent`` counts."""
    completions_topic: str
    workers: int
    pools: tuple[str, ...]
    partitions: int
    requests_per_worker_s: float
    duration_s: float

    @property
    def offered_per_s(self) -> float:
        """Telemetry records per second: one report per worker per interval."""
        return self.workers / TELEMETRY_INTERVAL_S

    @property
    def completions_per_s(self) -> float:
        return self.workers * self.requests_per_worker_s


def generator_main(load: Load, go: Event, out: Queue[Any]) -> None:
    try:
        asyncio.run(_generate(load, go, out))
    except BaseException as e:
        out.put(("error", traceback.format_exc()))
        raise SystemExit(1) from e


async def _generate(load: Load, go: Event, out: Queue[Any]) -> None:
    settings = CommonSettings(
        _env_file=None,
        control_keys_dir=control_keys(),
        kafka_bootstrap=load.bootstrap,
        kafka_idempotence=False,
        instance_id="bench-generator",
    )
    producer = make_producer(settings, linger_ms=5)
    await producer.start()
    try:
        requests = load.requests_per_worker_s * TELEMETRY_INTERVAL_S
        fleet = [
            SyntheticWorker(i, load.pools, load.partitions, requests) for i in range(load.workers)
        ]
        out.put(("ready", None))
        await asyncio.to_thread(go.wait)
        out.put(
            ("done", await _send_rounds(producer, load, [fleet[s::SLOTS] for s in range(SLOTS)]))
        )
    finally:
        await producer.stop()


async def _send_rounds(
    producer: AIOKafkaProducer, load: Load, slots: list[list[SyntheticWorker]]
) -> dict[str, Any]:
    """Each slot's workers send their round at the slot's time (or as soon as the
    generator gets to it, if it is behind), until ``duration_s`` has passed."""
    slot_s = TELEMETRY_INTERVAL_S / SLOTS
    requests = load.requests_per_worker_s * TELEMETRY_INTERVAL_S
    pending: deque[asyncio.Future[Any]] = deque()
    batches: dict[tuple[str, int], Any] = {}

    async def send(where: tuple[str, int]) -> None:
        topic, partition = where
        pending.append(await producer.send_batch(batches.pop(where), topic, partition=partition))

    async def append(where: tuple[str, int], key: bytes, value: bytes) -> None:
        batch = batches.get(where)
        headers = worker_mac(where[0], value)  # as a worker MACs it
        if (
            batch is None
            or batch.append(key=key, value=value, timestamp=None, headers=headers) is None
        ):
            if batch is not None:
                await send(where)
            batch = batches[where] = producer.create_batch()
            batch.append(key=key, value=value, timestamp=None, headers=headers)

    start, cpu_start = time.time(), time.process_time()
    end = start + load.duration_s
    sent, completions, k, progress = 0, 0, 0, [(0.0, 0)]
    while (due := start + k * slot_s) < end and time.time() < end:
        delay = due - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        stamp = repr(time.time()).encode()
        for worker in slots[k % SLOTS]:
            report, done = worker.round(stamp, requests)
            await append((load.topic, worker.partition), worker.key, report)
            sent += 1
            for value in done:
                await append((load.completions_topic, worker.partition), worker.key, value)
            completions += len(done)
        for where in list(batches):
            await send(where)
        while len(pending) > MAX_PENDING_BATCHES:
            await pending.popleft()
        k += 1
        if time.time() - start - progress[-1][0] >= SAMPLE_S / 2:
            progress.append((time.time() - start, sent))
    elapsed = time.time() - start
    await asyncio.gather(*pending)
    return {
        "sent": sent,
        "completions_sent": completions,
        "elapsed_s": elapsed,
        "cpu_s": time.process_time() - cpu_start,
        "progress": progress,
    }
