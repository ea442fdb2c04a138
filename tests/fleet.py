"""Test helpers that play the parts around a service: a dispatcher that produces
requests, a client that reads its reply topic and counts terminal replies, and real
workers on the simulated engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer

from schemas import (
    DispatchedRequest,
    InferenceReply,
    InferenceRequest,
    Priority,
    ReplyChunk,
    SamplingParams,
    WorkerReport,
)
from schemas.base import Message
from seawall_client.kafka import ensure_topics
from seawall_client.serde import COMPLETION, REPLY, TELEMETRY, decode, encode
from seawall_client.topics import Topics
from services.common.bus import make_consumer, make_producer
from services.common.lifecycle import cancel_tasks
from services.common.settings import CommonSettings
from services.workers.engine.factory import build_engine
from services.workers.engine.sim import SimulatedEngine
from services.workers.gpu import SimulatedGpuProbe
from services.workers.service import Worker
from services.workers.settings import WorkerSettings
from tests.signing import headers_for


def dispatched(
    i: int,
    reply_to: str,
    *,
    max_tokens: int = 32,
    stream: bool = True,
    pool: str = "main",
    deadline_in_s: float | None = None,
    priority: Priority = Priority.STANDARD,
    prompt: str | None = None,
    temperature: float = 1.0,
) -> DispatchedRequest:
    now = time.time()
    request = InferenceRequest(
        request_id=f"req-{i}",
        tenant="acme",
        prompt=prompt or f"tell me about item {i}",
        sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature),
        stream=stream,
        reply_to=reply_to,
        created_at=now,
        deadline_at=None if deadline_in_s is None else now + deadline_in_s,
        session_id=f"s{i}",
        priority=priority,
        pool=pool,
    )
    return DispatchedRequest(request=request, pool=pool, admitted_at=now)


async def produce(
    settings: CommonSettings, topic: str, messages: Iterable[Message | bytes]
) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        for i, msg in enumerate(messages):
            value = msg if isinstance(msg, bytes) else encode(msg)
            headers = headers_for(settings, topic, value)
            await producer.send_and_wait(topic, value, key=f"k{i}".encode(), headers=headers)
    finally:
        await producer.stop()


class ReplyReader:
    """Reads reply topics (created if need be; ``topic`` is the first's); keeps every
    chunk and terminal reply, duplicates included."""

    def __init__(
        self, settings: CommonSettings, topics: Topics, owner: str = "client", *more: str
    ) -> None:
        self.settings = settings
        self.topic = topics.reply(owner)
        self._specs = [topics.reply_spec(o) for o in (owner, *more)]
        self.chunks: dict[str, list[ReplyChunk]] = defaultdict(list)
        self.terminals: dict[str, list[InferenceReply]] = defaultdict(list)
        self._consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> ReplyReader:
        await ensure_topics(self.settings.kafka_bootstrap, self._specs)
        self._consumer = make_consumer(self.settings, *(s.name for s in self._specs), group_id=None)
        await self._consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._consumer is not None
        await self._consumer.stop()

    async def poll(self, timeout_ms: int = 200) -> None:
        assert self._consumer is not None
        batches = await self._consumer.getmany(timeout_ms=timeout_ms)
        for records in batches.values():
            for r in records:
                msg = decode(REPLY, r.value)
                if isinstance(msg, ReplyChunk):
                    self.chunks[msg.request_id].append(msg)
                else:
                    self.terminals[msg.request_id].append(msg)

    async def wait_terminals(self, n: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.terminals) < n and time.monotonic() < deadline:
            await self.poll()
        assert len(self.terminals) >= n, f"{len(self.terminals)} of {n} terminal replies"


async def read_telemetry(
    settings: CommonSettings, topics: Topics, want: set[str], timeout_s: float = 30
) -> dict[str, list[Message]]:
    """Telemetry and completions by type, until every type of ``want`` was seen: a
    report counts as itself and as each of its parts."""
    consumer = make_consumer(settings, topics.telemetry, topics.completions, group_id=None)
    await consumer.start()
    seen: dict[str, list[Message]] = defaultdict(list)
    try:
        deadline = time.monotonic() + timeout_s
        while not want <= set(seen) and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                for r in records:
                    if r.topic == topics.completions:
                        seen["request_completed"].append(decode(COMPLETION, r.value))
                        continue
                    msg = decode(TELEMETRY, r.value)
                    seen[msg.type].append(msg)
                    if isinstance(msg, WorkerReport):
                        for part in msg.parts():
                            seen[part.type].append(part)
    finally:
        await consumer.stop()
    return seen


async def until(
    predicate: Callable[[], bool],
    timeout_s: float = 30,
    every_s: float = 0.02,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(every_s)


def worker_settings(settings: CommonSettings, **changes: Any) -> WorkerSettings:
    base = settings.model_dump()
    base.update(
        instance_id="w1",
        telemetry_interval_s=0.2,
        commit_interval_s=0.05,
        shutdown_grace_s=5,
        sim_time_scale=1.0,
    )
    base.update(changes)
    return WorkerSettings(**base)


def sim_worker(settings: WorkerSettings) -> Worker:
    """A real worker on the simulated engine (not started)."""
    engine = build_engine(settings)
    assert isinstance(engine, SimulatedEngine)
    return Worker(settings, engine, SimulatedGpuProbe(lambda: [engine.gpu_reading()]))


@contextlib.asynccontextmanager
async def in_background(work: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Run ``work`` (a loop that feeds the system under test) while the block runs, and
    cancel it when the block ends (again and again if it swallows the cancellation, as
    a producer closing just then does). What ``work`` raised is raised here."""
    task = asyncio.create_task(work)
    try:
        yield
    finally:
        await cancel_tasks({task})
    if not task.cancelled() and (failure := task.exception()) is not None:
        raise failure


def spawn_service(
    settings: CommonSettings, module: str, name: str, log: Path, **env: str
) -> subprocess.Popen[bytes]:
    """A seawall service (``python -m <module>``) as its own process on the test's broker
    and Redis, instance ``name``, its output appended to ``log``; ``env``: more settings
    (``SEAWALL_…`` variables). The caller stops it."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SEAWALL_")}
    base.update(
        SEAWALL_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
        SEAWALL_KAFKA_IDEMPOTENCE=str(settings.kafka_idempotence).lower(),
        SEAWALL_TOPIC_PREFIX=settings.topic_prefix,
        SEAWALL_REDIS_URL=settings.redis_url,
        SEAWALL_REDIS_PREFIX=settings.redis_prefix,
        SEAWALL_INSTANCE_ID=name,
        SEAWALL_CONTROL_KEYS_DIR=str(settings.control_keys_dir or ""),
        SEAWALL_SAMPLING_SECRET_FILE=str(settings.sampling_secret_file or ""),
        **env,
    )
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module], env=base, stdout=out, stderr=subprocess.STDOUT
        )
