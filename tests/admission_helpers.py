"""Test helpers around admission: its settings for a test, requests, a capacity feed of
real ``EngineStats``/``WorkerHeartbeat`` records, and readers of the topics it writes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas import (
    ControlEvent,
    DeadLetter,
    DispatchedRequest,
    EngineStats,
    Evidence,
    InferenceRequest,
    Priority,
    SamplingParams,
    Tier,
    WorkerHeartbeat,
)
from schemas.base import Message
from seawall_client.serde import DISPATCH, decode, encode
from seawall_client.topics import Topics
from services.admission.policy.cost import NO_COST, Cost
from services.admission.policy.workers import WorkerStatus
from services.admission.settings import AdmissionSettings
from services.common.bus import make_consumer, make_producer
from services.common.control_state import ControlState
from services.common.lifecycle import Component
from services.common.settings import CommonSettings
from tests import builders
from tests.fleet import in_background
from tests.signing import headers_for

EVIDENCE = Evidence(reason="test")


@dataclass
class Item:
    """A waiting request as a dispatch round sees it (``dispatching.Waiting``)."""

    name: str
    since: float
    cost: Cost = NO_COST
    key: str = ""
    session: str | None = None


def admission_settings(settings: CommonSettings, **changes: Any) -> AdmissionSettings:
    base = settings.model_dump()
    base.update(commit_interval_s=0.05, dispatch_interval_s=0.02, shutdown_grace_s=5)
    base.update(changes)
    return AdmissionSettings(**base)


def inference_request(
    rid: str,
    reply_to: str,
    *,
    tenant: str = "acme",
    tier: Tier = Tier.PRO,
    priority: Priority = Priority.STANDARD,
    max_tokens: int = 16,
    pool: str = "main",
    region: str = "",
    deadline_in_s: float | None = None,
    temperature: float = 1.0,
) -> InferenceRequest:
    now = time.time()
    return InferenceRequest.model_validate(
        {
            "request_id": rid,
            "tenant": tenant,
            "tier": tier,
            "priority": priority,
            "pool": pool,
            "prompt": f"tell me about {rid}",
            "sampling": SamplingParams(max_tokens=max_tokens, temperature=temperature),
            "reply_to": reply_to,
            "created_at": now,
            "deadline_at": None if deadline_in_s is None else now + deadline_in_s,
            "session_id": f"s-{rid}",
            "client": {"region": region},
        }
    )


async def send_all(
    settings: CommonSettings, topic: str, messages: Sequence[Message | bytes | None]
) -> None:
    """Produce in order, each keyed by its position (``None`` is a tombstone)."""
    producer = make_producer(settings)
    await producer.start()
    try:
        for i, msg in enumerate(messages):
            value = msg if msg is None or isinstance(msg, bytes) else encode(msg)
            headers = headers_for(settings, topic, value)
            await producer.send_and_wait(topic, value, key=f"k{i}".encode(), headers=headers)
    finally:
        await producer.stop()


def engine_stats(
    worker_id: str,
    pool: str,
    batch_limit: int,
    in_flight: int = 0,
    max_model_len: int = 0,
    *,
    kv_capacity_tokens: int = 1_000_000,
    max_num_batched_tokens: int = 8192,
    kv_cache_usage: float = 0.0,
    preempted_total: int = 0,
    prefill_pending_tokens: int = 0,
) -> EngineStats:
    return builders.engine_stats(
        worker_id,
        time.time(),
        pool,
        engine="fake",
        running=in_flight,
        preempted_total=preempted_total,
        kv_cache_usage=kv_cache_usage,
        in_flight=in_flight,
        batch_limit=batch_limit,
        limits=builders.engine_limits(
            max_num_seqs=batch_limit,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_capacity_tokens=kv_capacity_tokens,
            max_model_len=max_model_len,
        ),
        prefill_pending_tokens=prefill_pending_tokens,
    )


def heartbeat(
    worker_id: str,
    pool: str = "main",
    batch_limit: int = 8,
    status: WorkerStatus = "serving",
    in_flight: int = 0,
) -> WorkerHeartbeat:
    now = time.time()
    return builders.heartbeat(
        worker_id,
        now,
        pool,
        engine="fake",
        status=status,
        in_flight=in_flight,
        batch_limit=batch_limit,
        host_cpu_pct=1.0,
        host_memory_pct=1.0,
        started_at=now,
    )


@contextlib.asynccontextmanager
async def capacity_feed(
    settings: CommonSettings,
    topics: Topics,
    pools: dict[str, int],
    every_s: float = 0.5,
) -> AsyncIterator[None]:
    """A fake worker per pool (``{pool: batch_limit}``) reporting an idle engine with the
    given batch limit, as real telemetry records, until the block ends."""
    producer = make_producer(settings)
    await producer.start()

    async def beat() -> None:
        while True:
            for pool, limit in pools.items():
                worker = f"fake-{pool}"
                for report in (engine_stats(worker, pool, limit), heartbeat(worker, pool, limit)):
                    value = encode(report)
                    await producer.send_and_wait(
                        topics.telemetry,
                        value,
                        key=worker.encode(),
                        headers=headers_for(settings, topics.telemetry, value),
                    )
            await asyncio.sleep(every_s)

    try:
        async with in_background(beat()):
            yield
    finally:
        await producer.stop()


class TopicReader:
    """Reads whole topics from their beginning (no group), in partition order."""

    def __init__(self, settings: CommonSettings, *topics: str) -> None:
        self.settings = settings
        self.topics = topics
        self.raw: dict[str, list[bytes]] = defaultdict(list)
        self._consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> TopicReader:
        self._consumer = make_consumer(self.settings, group_id=None)
        await self._consumer.start()
        await self._consumer.topics()
        tps = [
            TopicPartition(t, p)
            for t in self.topics
            for p in sorted(self._consumer.partitions_for_topic(t) or {0})
        ]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._consumer is not None
        await self._consumer.stop()

    async def poll(self, timeout_ms: int = 100) -> None:
        assert self._consumer is not None
        for tp, records in (await self._consumer.getmany(timeout_ms=timeout_ms)).items():
            self.raw[tp.topic] += [r.value for r in records if r.value is not None]

    async def until(self, topic: str, n: int, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.raw[topic]) < n and time.monotonic() < deadline:
            await self.poll()
        assert len(self.raw[topic]) >= n, f"{len(self.raw[topic])} of {n} records on {topic}"

    def dispatched(self, topic: str) -> list[DispatchedRequest]:
        return [decode(DISPATCH, raw) for raw in self.raw[topic]]

    def dead_letters(self, topic: str) -> list[DeadLetter]:
        return [DeadLetter.model_validate_json(raw) for raw in self.raw[topic]]


async def apply_control(
    settings: CommonSettings, topics: Topics, state: ControlState, *events: ControlEvent
) -> None:
    """Publish control events and wait until ``state`` (a service's) holds them all."""
    await send_all(settings, topics.control, list(events))
    deadline = time.monotonic() + 20
    while not all(state.get(type(e), e.scope) == e for e in events):
        assert time.monotonic() < deadline, "control events not applied in time"
        await asyncio.sleep(0.02)


def control_common(scope: str, seq: int) -> dict[str, Any]:
    return {"scope": scope, "seq": seq, "issued_at": time.time(), "evidence": EVIDENCE}


@contextlib.asynccontextmanager
async def started(*components: Component) -> AsyncIterator[None]:
    """Start components at once: a consumer-group join costs seconds on the embedded
    broker, so services started one after the other add those seconds up."""
    try:
        await asyncio.gather(*(c.start() for c in components))
        yield
    finally:
        await asyncio.gather(*(stopped_in_time(c) for c in components))


STOP_BOUND_S = 60.0
"""Longer than any drain the tests configure, far shorter than the test timeout."""


async def stopped_in_time(component: Component) -> None:
    """Stop ``component``, failing with its name if it hangs: a hung stop otherwise
    shows only as the whole test's timeout, with nothing that says whose it was."""
    try:
        async with asyncio.timeout(STOP_BOUND_S):
            await component.stop()
    except TimeoutError:
        raise AssertionError(f"{component.name} did not stop within {STOP_BOUND_S:.0f} s") from None
