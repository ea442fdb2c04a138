"""The worker: pulls its pool's dispatch topic, drives the engine, streams replies.

- At most ``batch_limit`` requests in flight; the limit comes from settings, then from
  ``BatchLimit`` control events (clamped to the engine's ``max_num_seqs``; back to the
  setting when the controller's decision expires). At the limit the worker simply
  stops asking the consumer for records.
- Each request is *claimed* before it is generated (``claims``): a request another
  worker is running (its partition moved) waits for that worker, one already answered
  is only committed, one whose worker died is taken over once its lease runs out, as a
  new generation that its chunks and terminal reply carry (readers drop a superseded
  generation's). A request redelivered to this worker while it runs it joins the run.
- Each request ends in exactly one terminal reply on its ``reply_to``; its offset is
  committed only after that reply is acknowledged (per partition, up to the lowest
  unfinished offset). A crash means redelivery, never loss; clients drop duplicates by
  request id.
- No record stops the worker (``services.common.consuming``): a record that does not
  decode, or whose ``reply_to`` is not an existing reply topic, is dead-lettered; a
  request the engine refuses (longer than its context) or whose processing fails on
  its own account is answered ``error``; the broker or Redis being unavailable makes
  the request wait and try again. Only the engine failing itself (``EngineError``)
  makes the worker exit non-zero: its unanswered requests go to the rest of the group,
  and its supervisor restarts it with a fresh engine (crash-only). A request that has
  been claimed ``max_attempts`` times is answered ``error`` instead of taking another
  worker down with it.
- SIGTERM: stop fetching, let in-flight requests finish within the grace period,
  commit, close. What did not finish is not committed, its claim is released, and it is
  redelivered.
- Its own breaker isolating it (``control.isolates``: errors, heartbeat loss, a failed
  probe, level 3+): it stops fetching, finishes what it has (within the grace period),
  commits and leaves its consumer group, so that its partitions go to the rest of the
  pool; it keeps publishing telemetry, and rejoins when the breaker turns half-open
  (the probes), closed, or expires. Admission stops placing work on it at once (its
  share is 0), but records already on its partitions, or keyed to them, need a new
  owner: leaving the group gives them one.
- Its consumer's session timeout is short (``consumer_session_timeout_ms``, 3 s): a SIGKILLed
  worker's partitions move within about 5 s, and its running requests' leases have run
  out by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from typing import Any, Literal

import psutil
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from schemas import (
    BatchLimit,
    BreakerLevel,
    BreakerState,
    ControlEvent,
    DispatchedRequest,
    EngineStats,
    InferenceReply,
    InferenceRequest,
    Profile,
    ReasonCode,
    ReplyChunk,
    ReplyStatus,
    RequestCompleted,
    WorkerHeartbeat,
    WorkerReport,
)
from schemas.base import Message
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import close, ensure_topics
from seawall_client.serde import DISPATCH, DecodeError, decode, encode
from seawall_client.topics import RedisKeys
from services.common.bus import commit_done, make_consumer, make_producer, topics_of
from services.common.consuming import Record, observe_lag, retry_unavailable
from services.common.control import ControlFollower, ControlState, isolates
from services.common.deadletters import DeadLetters, failure_of
from services.common.delivery import Replies, TopicDirectory, Undeliverable
from services.common.failures import Backoff, is_infrastructure
from services.common.lifecycle import Component, cancel_tasks
from services.common.offsets import OffsetTracker
from services.common.redisclient import make_redis
from services.common.tokenizer import count_tokens
from services.workers import metrics as m
from services.workers.chunker import Chunk, Coalescer
from services.workers.claims import Busy, Claimed, Claims, Done, Held
from services.workers.consistency import Comparison
from services.workers.dispatches import REPLY_TEXT_LIMIT, degraded_reason, engine_request_for
from services.workers.engine.base import Engine, EngineError, RequestRefused
from services.workers.engine.validate import validate_limits
from services.workers.gpu import GpuProbe
from services.workers.profiling import Profiles, answer
from services.workers.reports import gpu_stats, limits_info
from services.workers.settings import WorkerSettings
from services.workers.shadows import run_shadow, shadow_for, shadow_key, shadow_partition
from services.workers.summary import RequestSummarizer

log = logging.getLogger(__name__)

CLAIM_MARGIN_S = 60.0
"""A claim outlives its request's deadline by this much."""


class _Retry(Exception):
    """The broker or Redis failed mid-generation: this generation is given up, and the
    request is claimed and generated again after a backoff."""


class _Run:
    """A request this worker runs: its serving task's claim and the extra deliveries of
    the same request that wait for it (``(partition, offset)``)."""

    def __init__(self) -> None:
        self.held: Held | None = None
        self.engine_request_id: str | None = None
        self.lost = False
        """Its lease ran out and another worker took the request over."""
        self.joined: list[tuple[TopicPartition, int]] = []
        self.prefill_tokens = 0
        """Its prompt's tokens while the engine has them and no first token yet."""


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
            settings,
            self.topics.control,
            self.control,
            self._on_control,
            on_expire=self._on_control,
        )
        self._producer = make_producer(settings)
        self._dead_letters = DeadLetters(
            self._producer, self.topics.deadletter, f"worker:{self.worker_id}", clock
        )
        self._replies = Replies(
            self._producer, self.topics, TopicDirectory(self._producer, clock=clock)
        )
        self._redis = make_redis(settings)
        self.claims = Claims(
            self._redis, RedisKeys(settings.redis_prefix), self.worker_id, settings.claim_lease_s
        )
        self._consumer: AIOKafkaConsumer | None = None
        self._requests: dict[str, asyncio.Task[Any]] = {}
        self._runs: dict[str, _Run] = {}
        self.prefilled_tokens_total = 0
        """Prompt tokens whose first token came (``EngineStats.prefilled_tokens_total``)."""
        """Request id → the run of it in hand."""
        self._capacity = asyncio.Condition()
        self._draining = False
        self._isolated = False
        """What the latest breaker event for this worker says."""
        self.stepped_aside = False
        """Out of the consumer group because of it."""
        self._status: Literal["starting", "serving", "draining", "stopped"] = "starting"
        self.batch_limit = settings.batch_limit
        self.started_at = clock.time()
        self.incarnation = uuid.uuid4().hex[:16]
        self.profiles = Profiles(self.worker_id)
        """This process: an emergency restart names it (``WorkerHeartbeat``)."""
        self.completed_total = 0
        """Requests finished so far (``RequestCompleted.seq``, reports'
        ``completed_total``)."""
        self._summary = RequestSummarizer(self.started_at)
        self._fetcher: asyncio.Task[Any] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        """Commit, lease and telemetry loops: they run through the drain, then stop
        before what they use is closed."""

    # -- lifecycle -------------------------------------------------------------
    async def on_start(self) -> None:
        await self.engine.start()
        limits = self.engine.limits
        for warning in validate_limits(limits):
            log.warning("risky engine setting", extra={"warning": str(warning)})
        self.batch_limit = min(self.batch_limit, limits.max_num_seqs)
        m.BATCH_LIMIT.labels(self.settings.pool).set(self.batch_limit)
        specs = self.topics.specs()
        if self.settings.pool not in self.topics.pools:  # a canary's, or one not configured
            specs.append(self.topics.dispatch_spec(self.settings.pool))
        await ensure_topics(self.settings.kafka_bootstrap, specs, self.settings.topic_replication)
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
            self.spawn(self._lease_loop(), "leases"),
            self.spawn(self._telemetry_loop(), "telemetry"),
            self.spawn(self._watch(self._follower), "watch:control"),
        }
        log.info(
            "worker serving",
            extra={
                "worker": self.worker_id,
                "pool": self.settings.pool,
                "engine": self.engine.name,
                "batch_limit": self.batch_limit,
                "max_num_seqs": limits.max_num_seqs,
                "max_model_len": limits.max_model_len,
            },
        )

    @staticmethod
    async def _watch(part: Component) -> None:
        await part.failed.wait()
        raise RuntimeError(f"{part.name} failed") from part.failure

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
                await close(self._consumer)
            await self._follower.stop()
            await close(self._producer)
            await self._redis.aclose()
            await self.engine.stop()
            self.probe.close()

    # -- control ---------------------------------------------------------------
    def _on_control(self, event: ControlEvent) -> None:
        """A decision changed or expired: apply what is in force now (level-triggered)."""
        scope = f"worker:{self.worker_id}"
        if isinstance(event, Profile) and self.profiles.take(event, self.clock.time()):
            self.spawn(self._profile(event), f"profile:{event.request}")
        if isinstance(event, BatchLimit) and event.scope == scope:
            current = self.control.get(BatchLimit, scope)
            self.set_batch_limit(self.settings.batch_limit if current is None else current.limit)
        if isinstance(event, BreakerState) and event.scope == scope:
            breaker = self.control.get(BreakerState, scope)
            self._isolated = (
                self.settings.leave_group_when_isolated
                and breaker is not None
                and isolates(breaker)
            )
            self.spawn(self._notify_capacity(), "notify")  # the fetch loop acts on it
            if (
                breaker is event
                and event.level >= BreakerLevel.EMERGENCY
                and event.incarnation == self.incarnation  # not an order for another
            ):
                log.error(
                    "emergency restart ordered by the controller",
                    extra={"reason": event.evidence.reason},
                )
                self.failure = RuntimeError("emergency restart ordered by the controller")
                self.failed.set()

    async def _profile(self, request: Profile) -> None:
        """Run the engine's profiler as ``request`` asks; answer on the control topic."""
        self.profiles.running = True
        try:
            await self._answer(answer(request, "running", "profiling"))
            name = f"{self.worker_id}-{request.request}.prof"
            try:
                where = await self.engine.profile(request.seconds, self.settings.profile_dir / name)
            except Exception as e:  # the profiler's failure is the answer, never the worker's
                log.warning("profiling failed", extra={"error": repr(e)[:200]})
                await self._answer(answer(request, "failed", f"{type(e).__name__}: {e}"))
                return
            log.info("profile written", extra={"path": where})
            await self._answer(answer(request, "written", "profile written", where))
        finally:
            self.profiles.running = False

    async def _answer(self, event: Profile) -> None:
        await retry_unavailable(
            lambda: self._producer.send_and_wait(
                self.topics.control, encode(event), key=event.control_key.encode()
            ),
            Backoff(),
            "worker-profile",
        )

    def set_batch_limit(self, limit: int) -> None:
        new = max(1, min(limit, self.engine.limits.max_num_seqs))
        if new != self.batch_limit:
            log.info("batch limit changed", extra={"previous": self.batch_limit, "limit": new})
        self.batch_limit = new
        m.BATCH_LIMIT.labels(self.settings.pool).set(new)
        self.spawn(self._notify_capacity(), "notify")

    async def _notify_capacity(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    @property
    def prefill_pending_tokens(self) -> int:
        """Prompt tokens of the requests in the engine with no first token yet (what
        admission paces prefill against; engine-agnostic: counted here, not asked)."""
        return sum(r.prefill_tokens for r in self._runs.values())

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
        backoff = Backoff()
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
            batches = await retry_unavailable(
                functools.partial(
                    consumer.getmany, timeout_ms=200, max_records=self.batch_limit - self.in_flight
                ),
                backoff,
                "worker-fetch",
            )
            observe_lag("worker", consumer, batches)
            for tp, records in batches.items():
                for record in records:
                    self.offsets.track(tp, record.offset)
                    key = f"{tp.partition}:{record.offset}"
                    self._requests[key] = self.spawn(self._serve(tp, record, key), f"serve:{key}")
            m.IN_FLIGHT.labels(self.settings.pool).set(self.in_flight)

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
        m.STEPPED_ASIDE.labels(self.settings.pool).set(1)

    def _rejoin(self, consumer: AIOKafkaConsumer) -> None:
        log.info("my breaker lets me serve again: rejoining the group")
        consumer.subscribe([self.topics.dispatch(self.settings.pool)], listener=_Rebalance(self))
        self.stepped_aside = False
        m.STEPPED_ASIDE.labels(self.settings.pool).set(0)

    async def _serve(self, tp: TopicPartition, record: Record, key: str) -> None:
        """Settle one record: its request answered (or joined to the run of it in hand,
        or dead-lettered); then its offset may be committed."""
        rid: str | None = None
        run: _Run | None = None
        try:
            try:
                dispatched = decode(DISPATCH, record.value)
            except DecodeError as e:
                self._count("dead_letter", None)
                await self._dead_letters.record(record, e)
            else:
                if dispatched.shadow_of is not None:
                    await self._shadow(dispatched)
                    self.offsets.done(tp, record.offset)
                    return
                rid = dispatched.request.request_id
                if rid in self._runs:  # redelivered while this worker runs it
                    self._count("joined", dispatched.request)
                    self._runs[rid].joined.append((tp, record.offset))
                    rid = None  # not this task's run
                    return
                run = self._runs[rid] = _Run()
                try:
                    await self._handle(dispatched, record, run)
                except EngineError:
                    raise
                except Exception as e:  # the request's own failure: answered, never fatal
                    await self._answer_failure(dispatched, record, e)
            self.offsets.done(tp, record.offset)
            for joined in run.joined if run is not None else ():
                self.offsets.done(*joined)
        except EngineError as e:
            # Not this request's fault: leave it uncommitted for the group and exit, so
            # that a fresh engine replaces the broken one.
            log.error("engine failed", extra={"error": str(e)})
            self.failure = e
            self.failed.set()
        finally:
            if rid is not None:
                self._runs.pop(rid, None)
            if run is not None and run.held is not None and not run.lost:
                # Cut short (draining, the engine failed): the next owner need not wait
                # for the lease to run out.
                self._spawn_release(run.held)
            self._requests.pop(key, None)
            m.IN_FLIGHT.labels(self.settings.pool).set(self.in_flight)
            async with self._capacity:
                self._capacity.notify_all()

    async def _handle(self, d: DispatchedRequest, record: Record, run: _Run) -> None:
        req = d.request
        self._replies.check_name(req.reply_to)
        if not await retry_unavailable(
            lambda: self._replies.directory.exists(req.reply_to), Backoff(), "worker-reply"
        ):
            await self._replies.check(req.reply_to)  # raises Undeliverable, counted
        started = self.clock.time()
        if req.expired(started):
            reply = self._reply(
                req.request_id,
                ReplyStatus.EXPIRED,
                ReasonCode.DEADLINE_EXCEEDED,
                message="the deadline passed before a worker could start",
            )
            await self._finish(d, started, None, reply, run)
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
            await self._finish(d, started, None, reply, run)
            return
        backoff = Backoff()
        while True:
            claim = await self._claim(d)
            if isinstance(claim, Done):
                self._count("already_answered", req)
                return
            if isinstance(claim, Busy):
                # Alive elsewhere (its partition moved): wait for that worker, or for its
                # lease to run out.
                await asyncio.sleep(min(max(claim.retry_in_s, 0.05), self.settings.claim_lease_s))
                continue
            if claim.attempts:
                run.held = Held(req.tenant, req.request_id, claim.generation)
            if claim.attempts > self.settings.max_attempts:
                self._count("too_many_attempts", req)
                reply = self._reply(
                    req.request_id,
                    ReplyStatus.ERROR,
                    ReasonCode.ENGINE_ERROR,
                    code="too_many_attempts",
                    message=f"the request was started {claim.attempts - 1} times, and each "
                    "time its worker failed",
                    generation=claim.generation,
                )
                await self._finish(d, started, None, reply, run)
                return
            try:
                await self._generate(d, run, claim.generation)
                return
            except _Retry as e:
                log.warning(
                    "generation given up; trying again",
                    extra={"request_id": req.request_id, "error": repr(e.__cause__)[:200]},
                )
                if run.held is not None:
                    self._spawn_release(run.held)
                run.held, run.lost = None, False
                await backoff.wait()

    async def _claim(self, d: DispatchedRequest) -> Claimed | Busy | Done:
        """Claim the request; without Redis, an unclaimed generation from the local
        clock (``attempts`` 0)."""
        req = d.request
        now = self.clock.time()
        if req.deadline_at is not None:
            ttl_s = max(0.0, req.deadline_at - now) + CLAIM_MARGIN_S
        else:
            ttl_s = 3600.0
        try:
            return await self.claims.claim(req.tenant, req.request_id, ttl_s)
        except Exception as e:
            if not is_infrastructure(e):
                raise
            m.CLAIMS_UNAVAILABLE.inc()
            log.warning("claims unavailable; generating unclaimed", extra={"error": repr(e)[:200]})
            return Claimed(int(now * 1_000_000), 0)

    async def _generate(self, d: DispatchedRequest, run: _Run, generation: int) -> None:
        req = d.request
        started = self.clock.time()
        engine_request = engine_request_for(d, f"{req.request_id}#{generation}")
        run.engine_request_id = engine_request.request_id
        run.prefill_tokens = engine_request.prompt_tokens
        coalescer = Coalescer(self.settings.chunk_max_tokens, self.settings.chunk_max_interval_s)
        sends: list[asyncio.Future[Any]] = []
        parts: list[str] = []
        ttft: float | None = None
        finish_reason = None
        prompt_tokens, completion_tokens = engine_request.prompt_tokens, 0

        async def send_chunk(chunk: Chunk) -> None:
            msg = ReplyChunk(
                request_id=req.request_id,
                seq=chunk.seq,
                text=chunk.text,
                tokens=chunk.tokens,
                worker_id=self.worker_id,
                generation=generation,
            )
            try:
                sends.append(await self._replies.send(req.reply_to, msg, req.request_id))
            except Exception as e:
                if is_infrastructure(e):
                    await self.engine.abort(engine_request.request_id)
                    raise _Retry from e
                raise
            m.CHUNKS.inc()

        try:
            async for out in self.engine.generate(engine_request):
                now = self.clock.time()
                if ttft is None and out.new_tokens:
                    ttft = now - started
                    self.prefilled_tokens_total += run.prefill_tokens
                    run.prefill_tokens = 0
                parts.append(out.text)
                completion_tokens = out.completion_tokens
                prompt_tokens = out.prompt_tokens or prompt_tokens
                if req.stream:
                    chunk = coalescer.add(out.text, out.new_tokens, now)
                    if chunk is not None:
                        await send_chunk(chunk)
                if out.finished:
                    finish_reason = out.finish_reason
        finally:
            run.prefill_tokens = 0
        if run.lost:
            self._count("taken_over", req)
            return  # the new owner's generation answers it
        if req.stream:
            tail = coalescer.flush()
            if tail is not None:
                await send_chunk(tail)
        for ack in await asyncio.gather(*sends, return_exceptions=True):
            if isinstance(ack, BaseException):
                if is_infrastructure(ack):
                    raise _Retry from ack
                raise ack
        reason = degraded_reason(d)
        if finish_reason == "error":
            status, reason = ReplyStatus.ERROR, ReasonCode.ENGINE_ERROR
        else:
            status = ReplyStatus.DEGRADED if reason is not ReasonCode.NONE else ReplyStatus.OK
        reply = self._reply(
            req.request_id,
            status,
            reason,
            text="".join(parts)[:REPLY_TEXT_LIMIT],
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=finish_reason,
            chunks=coalescer.chunks_sent,
            generation=generation,
        )
        await self._finish(d, started, ttft, reply, run)

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

    async def _deliver(self, topic: str, message: InferenceReply, key: str) -> None:
        await (await self._replies.send(topic, message, key))

    async def _finish(
        self,
        d: DispatchedRequest,
        started: float,
        ttft: float | None,
        reply: InferenceReply,
        run: _Run,
    ) -> None:
        """Send the terminal reply and wait for the broker's ack (again after a backoff
        while the broker is unavailable); mark the claim done; then telemetry."""
        req = d.request
        await retry_unavailable(
            lambda: self._deliver(req.reply_to, reply, req.request_id), Backoff(), "worker-reply"
        )
        if run.held is not None:
            ttl_s = max(0.0, (req.deadline_at or 0.0) - self.clock.time()) + CLAIM_MARGIN_S
            try:
                await self.claims.done(run.held, ttl_s)
            except Exception as e:
                if not is_infrastructure(e):
                    raise
                log.warning("could not mark a request done", extra={"error": repr(e)[:200]})
            run.held = None  # nothing left to release
        latency = max(0.0, reply.completed_at - started)
        self._count(reply.status.value, req)
        m.LATENCY.labels(self.settings.pool, req.priority.value).observe(latency)
        if ttft is not None:
            m.TTFT.labels(self.settings.pool, req.priority.value).observe(ttft)
        self.completed_total += 1
        ok = reply.status is not ReplyStatus.ERROR
        self._summary.add(
            latency * 1000,
            ok,
            None if ttft is None else ttft * 1000,
            reply.prompt_tokens,
            reply.completion_tokens,
        )
        await self._publish(
            self.topics.completions,
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
                error=None if ok else reply.reason.value,
                at=self.clock.time(),
                seq=self.completed_total,
            ),
        )
        await self._send_shadow(d, reply)

    async def _shadow(self, d: DispatchedRequest) -> None:
        """Run a shadow of the output-consistency check and count how it compared; a
        shadow's own failure is counted, never answered (it answers nobody)."""
        pool = self.settings.pool
        try:
            outcome = await run_shadow(self.engine, d, self.worker_id, self.clock.time())
        except EngineError:
            raise
        except Exception as e:
            log.warning("a shadow run failed", extra={"error": repr(e)[:200]})
            m.CONSISTENCY.labels(pool, "failed").inc()
            return
        if isinstance(outcome, Comparison):
            self._summary.add_consistency(outcome.agrees, outcome.similarity)
            m.CONSISTENCY.labels(pool, "agree" if outcome.agrees else "differ").inc()
            m.CONSISTENCY_SIMILARITY.labels(pool).observe(outcome.similarity)
        else:
            m.CONSISTENCY.labels(pool, outcome).inc()

    def _count(self, outcome: str, req: InferenceRequest | None) -> None:
        """A dispatched record handled (``seawall_worker_requests_total``), by its
        request's class; ``None``: a record that did not decode, of no known class."""
        priority = "unknown" if req is None else req.priority.value
        m.REQUESTS.labels(self.settings.pool, priority, outcome).inc()

    async def _send_shadow(self, d: DispatchedRequest, reply: InferenceReply) -> None:
        """Send the shadow admission ordered for ``d``, if it did (not awaited: a lost
        shadow is one comparison fewer)."""
        shadow = shadow_for(d, reply, self.worker_id, self.clock.time())
        if shadow is None:
            return
        topic = self.topics.dispatch(shadow.pool)
        try:
            partition = None
            if shadow.pool == self.settings.pool:
                partition = shadow_partition(
                    shadow,
                    await self._producer.partitions_for(topic),
                    (tp.partition for tp in self.partitions),
                )
            await self._producer.send(
                topic, encode(shadow), key=shadow_key(shadow), partition=partition
            )
        except Exception as e:
            if not is_infrastructure(e):
                raise
            m.CONSISTENCY.labels(self.settings.pool, "not_sent").inc()

    async def _answer_failure(
        self, d: DispatchedRequest, record: Record, error: BaseException
    ) -> None:
        """A request that failed on its own account: an ``error`` reply (the engine
        refused it, or processing it failed), else — its reply topic is unusable — a
        dead letter."""
        req = d.request
        if isinstance(error, RequestRefused):
            self._count("refused", req)
            code, message = "engine_refused", str(error)[:512]
        else:
            code, message = failure_of(error)
        if not isinstance(error, Undeliverable):
            log.warning(
                "a request failed on its own account",
                extra={"request_id": req.request_id, "error": type(error).__name__},
            )
            reply = self._reply(
                req.request_id,
                ReplyStatus.ERROR,
                ReasonCode.INVALID_REQUEST,
                code=code,
                message=message,
            )
            try:
                await retry_unavailable(
                    lambda: self._deliver(req.reply_to, reply, req.request_id),
                    Backoff(),
                    "worker-reply",
                )
                return
            except Exception as e:
                if is_infrastructure(e):
                    raise
                error = e
        self._count("dead_letter", req)
        await self._dead_letters.record(record, error)

    # -- claims ----------------------------------------------------------------
    async def _lease_loop(self) -> None:
        """Renew the leases of the requests in hand; a lease found taken over (it ran
        out, another worker generates the request now) aborts this worker's run."""
        every = self.settings.claim_lease_s / 3
        while True:
            await asyncio.sleep(every)
            runs = [r for r in self._runs.values() if r.held is not None and not r.lost]
            if not runs:
                continue
            try:
                still = await self.claims.renew([r.held for r in runs if r.held is not None])
            except Exception as e:
                if not is_infrastructure(e):
                    raise
                log.warning("could not renew leases", extra={"error": repr(e)[:200]})
                continue
            for run, ours in zip(runs, still, strict=True):
                if not ours and not run.lost:
                    run.lost = True
                    log.warning("lease lost: another worker took the request over")
                    if run.engine_request_id is not None:
                        await self.engine.abort(run.engine_request_id)

    def _spawn_release(self, held: Held) -> None:
        self.spawn(self._release(held), "release")

    async def _release(self, held: Held) -> None:
        try:
            await self.claims.release(held)
        except Exception as e:  # a courtesy: the lease runs out by itself anyway
            log.info("could not release a claim", extra={"error": repr(e)[:200]})

    # -- commits ---------------------------------------------------------------
    async def commit_done(self) -> None:
        if self._consumer is not None:
            await commit_done(self._consumer, self.offsets)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.commit_interval_s)
            await self.commit_done()

    # -- telemetry -------------------------------------------------------------
    async def _publish(self, topic: str, message: Message) -> None:
        """Queue a telemetry or completion record (not awaited for its ack: a lost report
        is superseded by the next, and admission forgets a dispatch whose completion
        was lost after ``ledger_ttl_s``). Keyed by pool: the partition of the controller
        instance that decides for the pool (and still one partition per worker: its
        records stay in order)."""
        try:
            await self._producer.send(topic, encode(message), key=self.settings.pool.encode())
        except Exception as e:
            if not is_infrastructure(e):
                raise
            m.TELEMETRY_DROPPED.inc()

    async def _telemetry_loop(self) -> None:
        psutil.cpu_percent()  # the first call only sets the baseline
        while True:
            await asyncio.sleep(self.settings.telemetry_interval_s)
            await self._publish_stats()

    async def _publish_stats(self) -> None:
        """The interval's ``WorkerReport``: engine, GPUs, heartbeat and the summary of
        the requests finished, in one record."""
        now = self.clock.time()
        snap = self.engine.snapshot()
        m.ENGINE_RUNNING.labels(self.settings.pool).set(snap.running)
        m.ENGINE_WAITING.labels(self.settings.pool).set(snap.waiting)
        m.KV_USAGE.labels(self.settings.pool).set(snap.kv_cache_usage)
        m.PREEMPTED.labels(self.settings.pool).set(snap.preempted_total)
        engine = EngineStats(
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
            prefill_pending_tokens=self.prefill_pending_tokens,
            prefilled_tokens_total=self.prefilled_tokens_total,
            completed_total=self.completed_total,
        )
        gpus = []
        for g in self.probe.sample():
            m.export_gpu(self.settings.pool, g)
            gpus.append(gpu_stats(g, self.worker_id, self.settings.pool, now))
        await self._publish(
            self.topics.telemetry,
            WorkerReport(
                worker_id=self.worker_id,
                pool=self.settings.pool,
                at=now,
                heartbeat=self._heartbeat(now),
                engine=engine,
                gpus=tuple(gpus[:64]),
                requests=self._summary.take(now),
            ),
        )

    def _heartbeat(self, now: float) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            pool=self.settings.pool,
            engine=self.engine.name,
            status=self._status,
            in_flight=self.in_flight,
            batch_limit=self.batch_limit,
            host_cpu_pct=min(100.0, psutil.cpu_percent()),
            host_memory_pct=psutil.virtual_memory().percent,
            started_at=self.started_at,
            at=now,
            partitions=tuple(sorted(tp.partition for tp in self.partitions)),
            completed_total=self.completed_total,
            incarnation=self.incarnation,
        )

    async def _publish_heartbeat(self) -> None:
        """A heartbeat on its own: a status change (draining, stopped) told at once."""
        await self._publish(self.topics.telemetry, self._heartbeat(self.clock.time()))
