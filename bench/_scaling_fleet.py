"""The scaling benchmark's synthetic fleet: a load generator process playing ``W``
workers without engines.

Each worker sends what ``services/workers/service.py`` sends every
``telemetry_interval_s`` (1 s, the workers' default) — ``EngineStats``, one ``GpuStats``
(one GPU), ``WorkerHeartbeat`` — plus one ``RequestCompleted`` per finished request,
``requests_per_worker_s`` per second. Workers are spread evenly over the interval and
keyed by pool, like real ones. The records are the workers' own models, encoded once
per worker with ``serde.encode`` and re-stamped per send (``at`` and the request id
replaced in the bytes), sent in per-partition batches from one producer: the generator
shares 2 cores with the broker and the controllers, so it spends as little as it can, and
its achieved send rate is measured and reported.
"""

from __future__ import annotations

import asyncio
import random
import time
import traceback
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any

from _common import HEALTHY_TEMP_C, completed, engine_stats, gpu_stats, heartbeat
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner

from services.common.bus import make_producer
from services.common.serde import encode
from services.common.settings import CommonSettings
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

    def __init__(self, index: int, pools: Sequence[str], partitions: int) -> None:
        self.id = worker_id(index)
        pool = pool_of(index, pools)
        self.key = pool.encode()
        self.partition = partition_of(self.key, partitions)
        at = SENTINEL_AT
        self._stats = [
            encode(
                engine_stats(
                    self.id, pool, at, in_flight=8, kv_cache_usage=0.4, kv_capacity_tokens=119_184
                )
            ),
            encode(gpu_stats(self.id, pool, at, HEALTHY_TEMP_C)),
            encode(heartbeat(self.id, pool, at, in_flight=8, started_at=time.time())),
        ]
        self._completed = encode(
            completed(
                self.id,
                pool,
                at,
                SENTINEL_ID,
                ttft_ms=40.0,
                latency_ms=900.0,
                prompt_tokens=230,
                completion_tokens=200,
            )
        )
        if not all(SENTINEL_AT_JSON in t for t in (*self._stats, self._completed)):
            raise RuntimeError("the timestamp is not encoded as expected")
        self._debt = random.random()
        self._served = 0

    def round(self, stamp: bytes, requests: float) -> Iterator[bytes]:
        """One telemetry interval: the stats (in the worker's order), then ``requests``
        completions on average (the fraction carried over)."""
        for template in self._stats:
            yield template.replace(SENTINEL_AT_JSON, stamp)
        self._debt += requests
        n = int(self._debt)
        self._debt -= n
        for _ in range(n):
            self._served += 1
            request_id = b"%s-%d" % (self.id.encode(), self._served)
            yield self._completed.replace(SENTINEL_AT_JSON, stamp).replace(
                SENTINEL_ID.encode(), request_id
            )


@dataclass(frozen=True)
class Load:
    bootstrap: str
    topic: str
    workers: int
    pools: tuple[str, ...]
    partitions: int
    requests_per_worker_s: float
    duration_s: float

    @property
    def offered_per_s(self) -> float:
        return self.workers * (3 + self.requests_per_worker_s) / TELEMETRY_INTERVAL_S


def generator_main(load: Load, go: Event, out: Queue[Any]) -> None:
    try:
        asyncio.run(_generate(load, go, out))
    except BaseException as e:
        out.put(("error", traceback.format_exc()))
        raise SystemExit(1) from e


async def _generate(load: Load, go: Event, out: Queue[Any]) -> None:
    settings = CommonSettings(
        _env_file=None,
        kafka_bootstrap=load.bootstrap,
        kafka_idempotence=False,
        instance_id="bench-generator",
    )
    producer = make_producer(settings, linger_ms=5)
    await producer.start()
    try:
        fleet = [SyntheticWorker(i, load.pools, load.partitions) for i in range(load.workers)]
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
    batches: dict[int, Any] = {}

    async def send(partition: int) -> None:
        pending.append(
            await producer.send_batch(batches.pop(partition), load.topic, partition=partition)
        )

    start, cpu_start = time.time(), time.process_time()
    end = start + load.duration_s
    sent, k, progress = 0, 0, [(0.0, 0)]
    while (due := start + k * slot_s) < end and time.time() < end:
        delay = due - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        stamp = repr(time.time()).encode()
        for worker in slots[k % SLOTS]:
            for value in worker.round(stamp, requests):
                batch = batches.get(worker.partition)
                if (
                    batch is None
                    or batch.append(key=worker.key, value=value, timestamp=None) is None
                ):
                    if batch is not None:
                        await send(worker.partition)
                    batch = batches[worker.partition] = producer.create_batch()
                    batch.append(key=worker.key, value=value, timestamp=None)
                sent += 1
        for partition in list(batches):
            await send(partition)
        while len(pending) > MAX_PENDING_BATCHES:
            await pending.popleft()
        k += 1
        if time.time() - start - progress[-1][0] >= SAMPLE_S / 2:
            progress.append((time.time() - start, sent))
    elapsed = time.time() - start
    await asyncio.gather(*pending)
    return {
        "sent": sent,
        "elapsed_s": elapsed,
        "cpu_s": time.process_time() - cpu_start,
        "progress": progress,
    }
