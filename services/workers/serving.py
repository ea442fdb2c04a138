"""Serving one dispatched record: the run of its request, from claim to terminal reply.

A record that does not decode is dead-lettered; a shadow is run and counted
(``shadowing``); a request redelivered while this worker runs it joins that run.
Otherwise its reply topic is checked, an expired or statically degraded request is
answered at once, and the request is claimed (``leases``) and generated on the engine,
its chunks streamed (``policy.chunker``) and its terminal reply sent (``answers``). The
broker or Redis failing mid-generation gives that generation up and tries again after
a backoff; the request failing on its own account is answered, never fatal; only the
engine failing itself fails the worker. Then the record's offset (and those of the
deliveries that joined it) may be committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import TopicPartition

from schemas import DispatchedRequest, InferenceRequest, ReasonCode, ReplyChunk, ReplyStatus
from seawall_client import tracecontext
from seawall_client.clock import Clock
from seawall_client.serde import DISPATCH, DecodeError, decode
from seawall_client.tracecontext import TraceContext
from services.common.consuming import Record, retry_unavailable
from services.common.deadletters import DeadLetters
from services.common.delivery import Replies
from services.common.failures import Backoff, is_infrastructure
from services.common.hop_signing import hop_key_for, lacks_mac
from services.common.offsets import OffsetTracker
from services.common.tokenizer import count_tokens
from services.common.tracing import now_ns, produced_at_ns
from services.workers import metrics as m
from services.workers.answers import Answers
from services.workers.claims import Busy, Done, Held
from services.workers.engine.base import Engine, EngineError
from services.workers.leases import Leases
from services.workers.policy.chunker import Chunk, Coalescer
from services.workers.policy.dispatches import REPLY_TEXT_LIMIT, degraded_reason, engine_request_for
from services.workers.runs import InHand, Retry, Run
from services.workers.settings import WorkerSettings
from services.workers.shadowing import Shadowing
from services.workers.tracing import TRACER

log = logging.getLogger(__name__)


class Serving:
    """Serves the records the shell's fetch loop hands it, one task each."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        engine: Engine,
        replies: Replies,
        dead_letters: DeadLetters,
        offsets: OffsetTracker[TopicPartition],
        in_hand: InHand,
        answers: Answers,
        leases: Leases,
        shadowing: Shadowing,
        fail: Callable[[BaseException], None],
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.worker_id = settings.instance_id
        self.engine = engine
        self._hop = hop_key_for(settings, "dispatch")
        """Checks that a dispatch was written by admission or a worker (``hop_signing``)."""
        self._replies = replies
        self._dead_letters = dead_letters
        self.offsets = offsets
        self._in_hand = in_hand
        self._answers = answers
        self._leases = leases
        self._shadowing = shadowing
        self._fail = fail
        self.clock = clock

    async def serve(self, tp: TopicPartition, record: Record, key: str) -> None:
        """Settle one record: its request answered (or joined to the run of it in hand,
        or dead-lettered); then its offset may be committed."""
        rid: str | None = None
        run: Run | None = None
        trace = tracecontext.from_headers(record.headers)
        TRACER.record("worker.read", trace, produced_at_ns(record), now_ns())
        if lacks_mac(self._hop, tp.topic, record.value, record.headers):
            self.offsets.done(tp, record.offset)  # not admission's (or a worker's): skipped
            return
        try:
            try:
                dispatched = decode(DISPATCH, record.value)
            except DecodeError as e:
                self._answers.count("dead_letter", None)
                await self._dead_letters.record(record, e)
            else:
                if dispatched.shadow_of is not None:
                    await self._shadowing.run(dispatched)
                    self.offsets.done(tp, record.offset)
                    return
                rid = dispatched.request.scoped_id  # ids are unique per tenant only
                if rid in self._in_hand.runs:  # redelivered while this worker runs it
                    self._answers.count("joined", dispatched.request)
                    self._in_hand.runs[rid].joined.append((tp, record.offset))
                    rid = None  # not this task's run
                    return
                run = self._in_hand.runs[rid] = Run()
                try:
                    await self._handle(dispatched, record, run, trace)
                except EngineError:
                    raise
                except Exception as e:  # the request's own failure: answered, never fatal
                    await self._answers.fail(dispatched, record, e)
            self.offsets.done(tp, record.offset)
            for joined in run.joined if run is not None else ():
                self.offsets.done(*joined)
        except EngineError as e:
            # Not this request's fault: leave it uncommitted for the group and exit, so
            # that a fresh engine replaces the broken one.
            log.error("engine failed", extra={"error": str(e)})
            self._fail(e)
        finally:
            if rid is not None:
                self._in_hand.runs.pop(rid, None)
            if run is not None and run.held is not None and not run.lost:
                # Cut short (draining, the engine failed): the next owner need not wait
                # for the lease to run out.
                self._leases.spawn_release(run.held)
            self._in_hand.requests.pop(key, None)
            m.IN_FLIGHT.labels(self.settings.pool).set(self._in_hand.in_flight)
            async with self._in_hand.capacity:
                self._in_hand.capacity.notify_all()

    async def _handle(
        self, d: DispatchedRequest, record: Record, run: Run, trace: TraceContext | None
    ) -> None:
        req = d.request
        self._replies.check_name(req.reply_to)
        if not await retry_unavailable(
            lambda: self._replies.directory.exists(req.reply_to), Backoff(), "worker-reply"
        ):
            await self._replies.check(req.reply_to)  # raises Undeliverable, counted
        started = self.clock.time()
        if req.expired(started):
            await self._expired(d, started, run, "before a worker could start")
            return
        if d.degradation.static_reply:
            text = self.settings.static_reply
            reply = self._answers.reply(
                req.request_id,
                ReplyStatus.DEGRADED,
                ReasonCode.DEGRADED_STATIC,
                text=text,
                completion_tokens=count_tokens(text),
                finish_reason="stop",
            )
            await self._answers.finish(d, started, None, reply, run)
            return
        backoff = Backoff()
        while True:
            span = TRACER.start("worker.claim", trace)
            claim = await self._leases.claim(d)
            span.end()
            if isinstance(claim, Done):
                self._answers.count("already_answered", req)
                await self._answers.repeat(d)
                return
            if isinstance(claim, Busy):
                # Alive elsewhere (its partition moved): wait for that worker, or for its
                # lease to run out — no later than the request's deadline.
                now = self.clock.time()
                if req.expired(now):
                    await self._expired(d, started, run, "while another worker held it")
                    return
                wait = min(max(claim.retry_in_s, 0.05), self.settings.claim_lease_s)
                if req.deadline_at is not None:
                    wait = min(wait, max(0.0, req.deadline_at - now) + 0.01)
                await asyncio.sleep(wait)
                continue
            if claim.attempts:
                run.held = Held(req.tenant, req.request_id, claim.generation)
            if claim.attempts > self.settings.max_attempts:
                self._answers.count("too_many_attempts", req)
                reply = self._answers.reply(
                    req.request_id,
                    ReplyStatus.ERROR,
                    ReasonCode.ENGINE_ERROR,
                    code="too_many_attempts",
                    message=f"the request was started {claim.attempts - 1} times, and each "
                    "time its worker failed",
                    generation=claim.generation,
                )
                await self._answers.finish(d, started, None, reply, run)
                return
            try:
                await self._generate(d, run, claim.generation, trace)
                return
            except Retry as e:
                log.warning(
                    "generation given up; trying again",
                    extra={"request_id": req.request_id, "error": repr(e.__cause__)[:200]},
                )
                if run.held is not None:
                    self._leases.spawn_release(run.held)
                run.held, run.lost = None, False
                await backoff.wait()

    async def _expired(self, d: DispatchedRequest, started: float, run: Run, when: str) -> None:
        """Answer ``d`` expired, its deadline having passed ``when`` (no engine time)."""
        reply = self._answers.reply(
            d.request.request_id,
            ReplyStatus.EXPIRED,
            ReasonCode.DEADLINE_EXCEEDED,
            message=f"the deadline passed {when}",
        )
        await self._answers.finish(d, started, None, reply, run)

    def _patience_s(self, req: InferenceRequest) -> float:
        """How long to wait for the request's next output: its stall bound, or less,
        up to its deadline."""
        if req.deadline_at is None:
            return self.settings.request_stall_s
        return max(0.0, min(self.settings.request_stall_s, req.deadline_at - self.clock.time()))

    async def _generate(
        self, d: DispatchedRequest, run: Run, generation: int, trace: TraceContext | None
    ) -> None:
        """Run the request on the engine, stream its chunks, send its terminal reply;
        ``trace``: the span its stages are recorded under (``worker.generate`` over
        ``worker.first_token`` — the engine's queue and prefill — and
        ``worker.publish_first_chunk``)."""
        req = d.request
        started = self.clock.time()
        generate_ns = now_ns()
        generating = TRACER.start(
            "worker.generate", trace, generate_ns, generation=generation, worker=self.worker_id
        )
        engine_request = engine_request_for(d, f"{req.scoped_id}#{generation}")
        run.engine_request_id = engine_request.request_id
        run.prefill_tokens = engine_request.prompt_tokens
        coalescer = Coalescer(self.settings.chunk_max_tokens, self.settings.chunk_max_interval_s)
        sends: list[asyncio.Future[Any]] = []
        parts: list[str] = []
        ttft: float | None = None
        finish_reason = None
        prompt_tokens, completion_tokens = engine_request.prompt_tokens, 0

        async def send_chunk(chunk: Chunk) -> None:
            span = (
                TRACER.start("worker.publish_first_chunk", trace)
                if chunk.seq == 0 and generating.recording
                else None
            )
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
                if span is not None:
                    sends[-1].add_done_callback(lambda _: span.end())
            except Exception as e:
                if is_infrastructure(e):
                    await self.engine.abort(engine_request.request_id)
                    raise Retry from e
                raise
            m.CHUNKS.inc()

        outputs = self.engine.generate(engine_request)
        gave_up: str | None = None
        """Why the request was given up before the engine finished it, if it was."""
        self._in_hand.engine_started(self.clock.monotonic())
        try:
            while True:
                try:
                    async with asyncio.timeout(self._patience_s(req)):
                        out = await anext(outputs)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    # No output within the request's stall bound or before its deadline:
                    # given up, its GPU time freed.
                    gave_up = "expired" if req.expired(self.clock.time()) else "no_progress"
                    await self.engine.abort(engine_request.request_id)
                    break
                self._in_hand.progressed_at = self.clock.monotonic()
                now = self.clock.time()
                if ttft is None and out.new_tokens:
                    ttft = now - started
                    if generating.recording:
                        TRACER.record("worker.first_token", trace, generate_ns, now_ns())
                    self._in_hand.prefilled_tokens_total += run.prefill_tokens
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
            self._in_hand.engine_done()
            run.prefill_tokens = 0
            close = getattr(outputs, "aclose", None)  # an async generator: end it now
            if close is not None:
                await close()
        if run.lost:
            self._answers.count("taken_over", req)
            generating.set(taken_over=True)
            generating.end()
            return  # the new owner's generation answers it
        if req.stream and gave_up is None:
            tail = coalescer.flush()
            if tail is not None:
                await send_chunk(tail)
        for ack in await asyncio.gather(*sends, return_exceptions=True):
            if isinstance(ack, BaseException):
                if is_infrastructure(ack):
                    raise Retry from ack
                raise ack
        used: dict[str, Any] = {
            "text": "".join(parts)[:REPLY_TEXT_LIMIT],
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "chunks": coalescer.chunks_sent,
            "generation": generation,
        }
        if gave_up == "expired":
            reply = self._answers.reply(
                req.request_id,
                ReplyStatus.EXPIRED,
                ReasonCode.DEADLINE_EXCEEDED,
                message="the deadline passed while the request was generating",
                finish_reason="abort",
                **used,
            )
        elif gave_up == "no_progress":
            log.warning(
                "a request made no progress; given up",
                extra={"request_id": req.request_id, "stall_s": self.settings.request_stall_s},
            )
            reply = self._answers.reply(
                req.request_id,
                ReplyStatus.ERROR,
                ReasonCode.ENGINE_ERROR,
                code="no_progress",
                message=f"the engine produced nothing for it in "
                f"{self.settings.request_stall_s:g} s",
                finish_reason="abort",
                **used,
            )
        else:
            reason = degraded_reason(d)
            if finish_reason == "error":
                status, reason = ReplyStatus.ERROR, ReasonCode.ENGINE_ERROR
            else:
                status = ReplyStatus.DEGRADED if reason is not ReasonCode.NONE else ReplyStatus.OK
            reply = self._answers.reply(
                req.request_id, status, reason, finish_reason=finish_reason, **used
            )
        await self._answers.finish(d, started, ttft, reply, run)
        generating.end()
