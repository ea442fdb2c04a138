"""The worker: pulls its pool's dispatch topic, drives the engine, streams replies.

- At most ``batch_limit`` requests in flight; the limit comes from settings, then from
  ``BatchLimit`` control events (clamped to the engine's ``max_num_seqs``). At the limit
  the worker simply stops asking the consumer for records.
- Each request ends in exactly one terminal reply on its ``reply_to``; its offset is
  committed only after that reply is acknowledged (per partition, up to the lowest
  unfinished offset). A crash means redelivery, never loss; clients drop duplicates by
  request id.
- An engine failure (``EngineError`` raised, not a request that finished with an error)
  makes the worker exit non-zero: its unanswered requests go to the rest of the group,
  and its supervisor restarts it with a fresh engine (crash-only).
- SIGTERM: stop fetching, let in-flight requests finish within the grace period,
  commit, close. What did not finish is not committed and is redelivered.
- Its own breaker isolating it (``control.isolates``: errors, heartbeat loss, a failed
  probe, level 3+): it stops fetching, finishes what it has (within the grace period),
  commits and leaves its consumer group, so that its partitions go to the rest of the
  pool; it keeps publishing telemetry, and rejoins when the breaker turns half-open
  (the probes) or closed. Admission's capacity count alone would not divert the work:
  records are spread over partitions, not over workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Literal

import psutil
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError
from aiokafka.structs import ConsumerRecord

from schemas import (
    BatchLimit,
    BreakerLevel,
    BreakerState,
    ControlEvent,
    DispatchedRequest,
    EngineStats,
    InferenceReply,
    ReasonCode,
    ReplyChunk,
    ReplyStatus,
    RequestCompleted,
    WorkerHeartbeat,
)
from schemas.base import Message
from schemas.requests import Priority
from services.common.bus import (
    commit_done,
    dead_letter_record,
    ensure_topics,
    make_consumer,
    make_producer,
    topics_of,
)
from services.common.clock import SYSTEM_CLOCK, Clock
from services.common.control import ControlFollower, ControlState, isolates
from services.common.lifecycle import Component, cancel_tasks
from services.common.offsets import OffsetTracker
from services.common.serde import DISPATCH, DecodeError, decode, encode
from services.common.tokenizer import count_tokens
from services.workers import metrics as m
from services.workers.chunker import Coalescer
from services.workers.engine.base import Engine, EngineError, EngineRequest
from services.workers.engine.validate import validate_limits
from services.workers.gpu import GpuProbe
from services.workers.reports import gpu_stats, limits_info
from services.workers.settings import WorkerSettings

log = logging.getLogger(__name__)

#: vLLM's ``priority``: lower runs first.
ENGINE_PRIORITY = {Priority.VIP: 0, Priority.STANDARD: 1, Priority.BULK: 2}


def prompt_text(d: DispatchedRequest) -> str:
    """The prompt the engine sees: chat messages flattened as ``role: content`` lines."""
    req = d.request
    if req.prompt is not None:
        return req.prompt
    assert req.messages is not None
    return "\n".join(f"{msg.role}: {msg.content}" for msg in req.messages) + "\nassistant:"


def degraded_reason(d: DispatchedRequest) -> ReasonCode:
    g = d.degradation
    if g.static_reply:
        return ReasonCode.DEGRADED_STATIC
    if g.max_tokens_cap is not None and g.max_tokens_cap < d.request.sampling.max_tokens:
        return ReasonCode.DEGRADED_TRUNCATED
    if g.diverted_from is not None:
        return ReasonCode.DEGRADED_SMALL_MODEL
    if g.quota_degraded:
        return ReasonCode.QUOTA_DEGRADED
    return ReasonCode.NONE


def max_output_tokens(d: DispatchedRequest) -> int:
    """What the client asked for, within degradation level 2's cap."""
    cap = d.degradation.max_tokens_cap
    wanted = d.request.sampling.max_tokens
    return wanted if cap is None else min(wanted, cap)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._worker.commit_done()
        self._worker.offsets.forget(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        log.info("partitions assigned", extra={"partitions": len(assigned)})


class Worker(Component):
    name = "worker"

    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        probe: GpuProbe,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.engine = engine
        self.probe = probe
        self.clock = clock
        self.worker_id = settings.instance_id
        self.topics = topics_of(settings)
        self.offsets: OffsetTracker[TopicPartition] = OffsetTracker()
        self.control = ControlState(clock)
        self._follower = ControlFollower(
            settings, self.topics.control, self.control, self._on_control
        )
        self._producer = make_producer(settings)
        self._consumer: AIOKafkaConsumer | None = None
        self._requests: dict[str, asyncio.Task[Any]] = {}
        self._capacity = asyncio.Condition()
        self._draining = False
        self._isolated = False
        """What the latest breaker event for this worker says."""
        self.stepped_aside = False
        """Out of the consumer group because of it."""
        self._status: Literal["starting", "serving", "draining", "stopped"] = "starting"
        self.batch_limit = settings.batch_limit
        self.started_at = clock.time()
        self._fetcher: asyncio.Task[Any] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        """Commit and telemetry loops: they run through the drain, then stop before what
        they use is closed."""

    # -- lifecycle -------------------------------------------------------------
    async def on_start(self) -> None:
        await self.engine.start()
        limits = self.engine.limits
        for warning in validate_limits(limits):
            log.warning("risky engine setting", extra={"warning": str(warning)})
        self.batch_limit = min(self.batch_limit, limits.max_num_seqs)
        m.BATCH_LIMIT.set(self.batch_limit)
        await ensure_topics(self.settings.kafka_bootstrap, self.topics.specs())
        await self._producer.start()
        await self._follower.start()
        self._consumer = make_consumer(
            self.settings,
            group_id=f"{self.settings.topic_prefix}seawall.workers.{self.settings.pool}",
        )
        self._consumer.subscribe(
            [self.topics.dispatch(self.settings.pool)], listener=_Rebalance(self)
        )
        await self._consumer.start()
        self._status = "serving"
        self._fetcher = self.spawn(self._fetch_loop(), "fetch")
        self._background = {
            self.spawn(self._commit_loop(), "commit"),
            self.spawn(self._telemetry_loop(), "telemetry"),
        }
        log.info(
            "worker serving",
            extra={
                "worker": self.worker_id,
                "pool": self.settings.pool,
                "engine": self.engine.name,
                "batch_limit": self.batch_limit,
                "max_num_seqs": limits.max_num_seqs,
            },
        )

    async def on_stop(self) -> None:
        self._status = "draining"
        self._draining = True
        async with self._capacity:
            self._capacity.notify_all()
        if self._fetcher is not None:
            await cancel_tasks({self._fetcher})
        pending = set(self._requests.values())
        if pending:
            log.info(
                "draining",
                extra={"in_flight": len(pending), "grace_s": self.settings.shutdown_grace_s},
            )
            _, unfinished = await asyncio.wait(pending, timeout=self.settings.shutdown_grace_s)
            if unfinished:
                log.warning(
                    "grace period over; redelivering the rest",
                    extra={"unfinished": len(unfinished)},
                )
                await cancel_tasks(unfinished)
        await cancel_tasks(self._background)
        try:
            await self.commit_done()
        finally:
            self._status = "stopped"
            # The last heartbeat is a courtesy: a broker already gone must not turn a
            # clean stop into a failure.
            with contextlib.suppress(KafkaError, OSError):
                await self._publish_heartbeat()
            if self._consumer is not None:
                await self._consumer.stop()
            await self._follower.stop()
            await self._producer.stop()
            await self.engine.stop()
            self.probe.close()

    # -- control ---------------------------------------------------------------
    def _on_control(self, event: ControlEvent) -> None:
        if isinstance(event, BatchLimit) and event.worker_id == self.worker_id:
            self.set_batch_limit(event.limit)
        if isinstance(event, BreakerState) and event.scope == f"worker:{self.worker_id}":
            self._isolated = self.settings.leave_group_when_isolated and isolates(event)
            self.spawn(self._notify_capacity(), "notify")  # the fetch loop acts on it
        if (
            isinstance(event, BreakerState)
            and event.scope == f"worker:{self.worker_id}"
            and event.level >= BreakerLevel.EMERGENCY
            and event.issued_at > self.started_at  # an order for an earlier incarnation
        ):
            log.error(
                "emergency restart ordered by the controller",
                extra={"reason": event.evidence.reason},
            )
            self.failure = RuntimeError("emergency restart ordered by the controller")
            self.failed.set()

    def set_batch_limit(self, limit: int) -> None:
        new = max(1, min(limit, self.engine.limits.max_num_seqs))
        if new != self.batch_limit:
            log.info("batch limit changed", extra={"previous": self.batch_limit, "limit": new})
        self.batch_limit = new
        m.BATCH_LIMIT.set(new)
        self.spawn(self._notify_capacity(), "notify")

    async def _notify_capacity(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def partitions(self) -> frozenset[TopicPartition]:
        """The dispatch partitions the group gave this worker."""
        return frozenset(self._consumer.assignment()) if self._consumer else frozenset()

    # -- consuming -------------------------------------------------------------
    async def _fetch_loop(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        while not self._draining:
            async with self._capacity:
                await self._capacity.wait_for(
                    lambda: (
                        self._draining
                        or self._isolated != self.stepped_aside
                        or (self.in_flight < self.batch_limit and not self.stepped_aside)
                    )
                )
            if self._draining:
                return
            if self._isolated and not self.stepped_aside:
                await self._step_aside(consumer)
                continue
            if not self._isolated and self.stepped_aside:
                self._rejoin(consumer)
                continue
            room = self.batch_limit - self.in_flight
            batches = await consumer.getmany(timeout_ms=200, max_records=room)
            for tp, records in batches.items():
                for record in records:
                    self.offsets.track(tp, record.offset)
                    key = f"{tp.partition}:{record.offset}"
                    self._requests[key] = self.spawn(self._serve(tp, record, key), f"serve:{key}")
            m.IN_FLIGHT.set(self.in_flight)

    async def _step_aside(self, consumer: AIOKafkaConsumer) -> None:
        log.warning(
            "my breaker isolates me: leaving the group",
            extra={"in_flight": self.in_flight, "grace_s": self.settings.shutdown_grace_s},
        )
        pending = set(self._requests.values())
        if pending:
            await asyncio.wait(pending, timeout=self.settings.shutdown_grace_s)
        await self.commit_done()
        # What is still running is redelivered to the new owners of its partitions.
        self.offsets.forget(consumer.assignment())
        consumer.unsubscribe()
        self.stepped_aside = True
        m.STEPPED_ASIDE.set(1)

    def _rejoin(self, consumer: AIOKafkaConsumer) -> None:
        log.info("my breaker lets me serve again: rejoining the group")
        consumer.subscribe([self.topics.dispatch(self.settings.pool)], listener=_Rebalance(self))
        self.stepped_aside = False
        m.STEPPED_ASIDE.set(0)

    async def _serve(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], key: str
    ) -> None:
        try:
            try:
                dispatched = decode(DISPATCH, record.value)
            except DecodeError as e:
                m.REQUESTS.labels("dead_letter").inc()
                await dead_letter_record(
                    self._producer,
                    self.topics,
                    record,
                    e,
                    service=f"worker:{self.worker_id}",
                    clock=self.clock,
                )
            else:
                try:
                    await self._answer(dispatched, record)
                except EngineError as e:
                    # Not this request's fault: leave it uncommitted for the group and
                    # exit, so that a fresh engine replaces the broken one.
                    log.error("engine failed", extra={"error": str(e)})
                    self.failure = e
                    self.failed.set()
                    return
            self.offsets.done(tp, record.offset)
        finally:
            self._requests.pop(key, None)
            m.IN_FLIGHT.set(self.in_flight)
            async with self._capacity:
                self._capacity.notify_all()

    async def _answer(self, d: DispatchedRequest, record: ConsumerRecord[bytes, bytes]) -> None:
        req = d.request
        started = self.clock.time()
        if req.expired(started):
            reply = self._reply(
                req.request_id,
                ReplyStatus.EXPIRED,
                ReasonCode.DEADLINE_EXCEEDED,
                message="the deadline passed before a worker could start",
            )
            await self._finish(d, record, started, None, reply)
            return
        if d.degradation.static_reply:
            text = self.settings.static_reply
            reply = self._reply(
                req.request_id,
                ReplyStatus.DEGRADED,
                ReasonCode.DEGRADED_STATIC,
                text=text,
                completion_tokens=count_tokens(text),
                finish_reason="stop",
            )
            await self._finish(d, record, started, None, reply)
            return
        prompt = prompt_text(d)
        engine_request = EngineRequest(
            request_id=f"{req.request_id}#{d.attempt}",
            prompt=prompt,
            prompt_tokens=count_tokens(prompt),
            max_tokens=max_output_tokens(d),
            temperature=req.sampling.temperature,
            top_p=req.sampling.top_p,
            stop=req.sampling.stop,
            priority=ENGINE_PRIORITY[req.priority],
            seed=req.sampling.seed,
        )
        coalescer = Coalescer(self.settings.chunk_max_tokens, self.settings.chunk_max_interval_s)
        sends: list[asyncio.Future[Any]] = []
        parts: list[str] = []
        ttft: float | None = None
        finish_reason = None
        prompt_tokens, completion_tokens = engine_request.prompt_tokens, 0
        async for out in self.engine.generate(engine_request):
            now = self.clock.time()
            if ttft is None and out.new_tokens:
                ttft = now - started
            parts.append(out.text)
            completion_tokens = out.completion_tokens
            prompt_tokens = out.prompt_tokens or prompt_tokens
            if req.stream:
                chunk = coalescer.add(out.text, out.new_tokens, now)
                if chunk is not None:
                    sends.append(await self._send_chunk(req.reply_to, req.request_id, chunk))
            if out.finished:
                finish_reason = out.finish_reason
        if req.stream:
            tail = coalescer.flush()
            if tail is not None:
                sends.append(await self._send_chunk(req.reply_to, req.request_id, tail))
        await asyncio.gather(*sends)
        reason = degraded_reason(d)
        if finish_reason == "error":
            status, reason = ReplyStatus.ERROR, ReasonCode.ENGINE_ERROR
        else:
            status = ReplyStatus.DEGRADED if reason is not ReasonCode.NONE else ReplyStatus.OK
        reply = self._reply(
            req.request_id,
            status,
            reason,
            text="".join(parts)[:65_536],
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=finish_reason,
            chunks=coalescer.chunks_sent,
        )
        await self._finish(d, record, started, ttft, reply)

    def _reply(
        self, request_id: str, status: ReplyStatus, reason: ReasonCode, **fields: Any
    ) -> InferenceReply:
        return InferenceReply(
            request_id=request_id,
            status=status,
            reason=reason,
            worker_id=self.worker_id,
            completed_at=self.clock.time(),
            **fields,
        )

    async def _send_chunk(self, topic: str, request_id: str, chunk: Any) -> asyncio.Future[Any]:
        m.CHUNKS.inc()
        msg = ReplyChunk(
            request_id=request_id,
            seq=chunk.seq,
            text=chunk.text,
            tokens=chunk.tokens,
            worker_id=self.worker_id,
        )
        fut: asyncio.Future[Any] = await self._producer.send(
            topic, encode(msg), key=request_id.encode()
        )
        return fut

    async def _finish(
        self,
        d: DispatchedRequest,
        record: ConsumerRecord[bytes, bytes],
        started: float,
        ttft: float | None,
        reply: InferenceReply,
    ) -> None:
        """Send the terminal reply and wait for the broker's ack; then telemetry."""
        req = d.request
        try:
            await self._producer.send_and_wait(
                req.reply_to, encode(reply), key=req.request_id.encode()
            )
        except KafkaTimeoutError:
            # The reply topic does not exist (or the broker is gone: then this fails too,
            # and the worker restarts). Keep the request where an operator can see it.
            await dead_letter_record(
                self._producer,
                self.topics,
                record,
                DecodeError("reply_topic_unreachable", f"could not deliver to {req.reply_to!r}"),
                service=f"worker:{self.worker_id}",
                clock=self.clock,
            )
        latency = max(0.0, reply.completed_at - started)
        m.REQUESTS.labels(reply.status.value).inc()
        m.LATENCY.observe(latency)
        if ttft is not None:
            m.TTFT.observe(ttft)
        await self._publish(
            RequestCompleted(
                worker_id=self.worker_id,
                pool=self.settings.pool,
                request_id=req.request_id,
                tenant=req.tenant,
                priority=req.priority,
                tier=req.tier,
                queue_wait_ms=min(86_400_000, max(0.0, started - d.admitted_at) * 1000),
                ttft_ms=None if ttft is None else ttft * 1000,
                latency_ms=latency * 1000,
                prompt_tokens=reply.prompt_tokens,
                completion_tokens=reply.completion_tokens,
                error=reply.reason.value if reply.status is ReplyStatus.ERROR else None,
                at=self.clock.time(),
            )
        )

    # -- commits ---------------------------------------------------------------
    async def commit_done(self) -> None:
        if self._consumer is not None:
            await commit_done(self._consumer, self.offsets)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.commit_interval_s)
            await self.commit_done()

    # -- telemetry -------------------------------------------------------------
    async def _publish(self, message: Message) -> None:
        # Keyed by pool: the partition of the controller instance that decides for the
        # pool (and still one partition per worker: its records stay in order).
        await self._producer.send(
            self.topics.telemetry, encode(message), key=self.settings.pool.encode()
        )

    async def _telemetry_loop(self) -> None:
        psutil.cpu_percent()  # the first call only sets the baseline
        while True:
            await asyncio.sleep(self.settings.telemetry_interval_s)
            await self._publish_stats()

    async def _publish_stats(self) -> None:
        now = self.clock.time()
        snap = self.engine.snapshot()
        m.ENGINE_RUNNING.set(snap.running)
        m.ENGINE_WAITING.set(snap.waiting)
        m.KV_USAGE.set(snap.kv_cache_usage)
        m.PREEMPTED.set(snap.preempted_total)
        await self._publish(
            EngineStats(
                worker_id=self.worker_id,
                pool=self.settings.pool,
                engine=self.engine.name,
                running=snap.running,
                waiting=snap.waiting,
                preempted_total=snap.preempted_total,
                kv_cache_usage=min(1.0, max(0.0, snap.kv_cache_usage)),
                in_flight=self.in_flight,
                batch_limit=self.batch_limit,
                limits=limits_info(snap.limits),
                at=now,
            )
        )
        for g in self.probe.sample():
            m.GPU_MEMORY.labels(str(g.index)).set(g.memory_used_bytes)
            m.GPU_TEMPERATURE.labels(str(g.index)).set(g.temperature_c)
            await self._publish(gpu_stats(g, self.worker_id, self.settings.pool, now))
        await self._publish_heartbeat()

    async def _publish_heartbeat(self) -> None:
        await self._publish(
            WorkerHeartbeat(
                worker_id=self.worker_id,
                pool=self.settings.pool,
                engine=self.engine.name,
                status=self._status,
                in_flight=self.in_flight,
                batch_limit=self.batch_limit,
                host_cpu_pct=min(100.0, psutil.cpu_percent()),
                host_memory_pct=psutil.virtual_memory().percent,
                started_at=self.started_at,
                at=self.clock.time(),
            )
        )
