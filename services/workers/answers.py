"""The worker's terminal answers: each request's one terminal reply, and what follows it.

A reply is sent on the request's ``reply_to`` and waited for until the broker has it
(again after a backoff while the broker is unavailable); then the request's claim is
marked done, its outcome counted (metrics, the report's summary, a ``RequestCompleted``
record) and the shadow admission ordered for it sent. A request that failed on its own
account is answered ``error``, or dead-lettered when its reply topic is unusable.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from schemas import (
    DispatchedRequest,
    InferenceReply,
    InferenceRequest,
    ReasonCode,
    ReplyStatus,
    RequestCompleted,
)
from schemas.base import Message
from seawall_client.clock import Clock
from seawall_client.topics import Topics
from services.common.consuming import Record, retry_unavailable
from services.common.deadletters import DeadLetters, failure_of
from services.common.delivery import Replies, Undeliverable
from services.common.failures import Backoff, is_infrastructure
from services.workers import metrics as m
from services.workers.claims import Claims
from services.workers.engine.base import RequestRefused
from services.workers.policy.summary import RequestSummarizer
from services.workers.runs import CLAIM_MARGIN_S, InHand, Run
from services.workers.settings import WorkerSettings
from services.workers.shadowing import Shadowing

log = logging.getLogger(__name__)


class Answers:
    """Builds, delivers and accounts for the worker's terminal replies."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        topics: Topics,
        replies: Replies,
        dead_letters: DeadLetters,
        claims: Claims,
        in_hand: InHand,
        summary: RequestSummarizer,
        publish: Callable[[str, Message], Awaitable[None]],
        shadowing: Shadowing,
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.worker_id = settings.instance_id
        self.topics = topics
        self._replies = replies
        self._dead_letters = dead_letters
        self.claims = claims
        self._in_hand = in_hand
        self._summary = summary
        self._publish = publish
        self._shadowing = shadowing
        self.clock = clock

    def reply(
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

    async def finish(
        self,
        d: DispatchedRequest,
        started: float,
        ttft: float | None,
        reply: InferenceReply,
        run: Run,
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
        self.count(reply.status.value, req)
        m.LATENCY.labels(self.settings.pool, req.priority.value).observe(latency)
        if ttft is not None:
            m.TTFT.labels(self.settings.pool, req.priority.value).observe(ttft)
        self._in_hand.completed_total += 1
        ok = reply.status is not ReplyStatus.ERROR
        self._summary.add(
            latency * 1000,
            ok,
            None if ttft is None else ttft * 1000,
            reply.prompt_tokens,
            reply.completion_tokens,
        )
        await self._completed(
            req,
            queue_wait_ms=min(86_400_000, max(0.0, started - d.admitted_at) * 1000),
            ttft_ms=None if ttft is None else ttft * 1000,
            latency_ms=latency * 1000,
            prompt_tokens=reply.prompt_tokens,
            completion_tokens=reply.completion_tokens,
            error=None if ok else reply.reason.value,
            seq=self._in_hand.completed_total,
        )
        await self._shadowing.send(d, reply)

    async def repeat(self, d: DispatchedRequest) -> None:
        """A dispatch of a request already answered: say so on ``llm.completions``
        (``RequestCompleted.repeat``), so that the admission that sent it frees the
        slot its ledger holds for it — no real completion will ever come for it."""
        await self._completed(
            d.request,
            queue_wait_ms=0.0,
            latency_ms=0.0,
            prompt_tokens=0,
            completion_tokens=0,
            repeat=True,
        )

    async def _completed(self, req: InferenceRequest, **figures: Any) -> None:
        """A ``RequestCompleted`` of ``req`` with ``figures``, onto ``llm.completions``."""
        await self._publish(
            self.topics.completions,
            RequestCompleted(
                worker_id=self.worker_id,
                pool=self.settings.pool,
                request_id=req.request_id,
                tenant=req.tenant,
                priority=req.priority,
                tier=req.tier,
                at=self.clock.time(),
                **figures,
            ),
        )

    def count(self, outcome: str, req: InferenceRequest | None) -> None:
        """A dispatched record handled (``seawall_worker_requests_total``), by its
        request's class; ``None``: a record that did not decode, of no known class."""
        priority = "unknown" if req is None else req.priority.value
        m.REQUESTS.labels(self.settings.pool, priority, outcome).inc()

    async def fail(self, d: DispatchedRequest, record: Record, error: BaseException) -> None:
        """A request that failed on its own account: an ``error`` reply (the engine
        refused it, or processing it failed), else — its reply topic is unusable — a
        dead letter."""
        req = d.request
        if isinstance(error, RequestRefused):
            self.count("refused", req)
            code, message = "engine_refused", str(error)[:512]
        else:
            code, message = failure_of(error)
        if not isinstance(error, Undeliverable):
            log.warning(
                "a request failed on its own account",
                extra={"request_id": req.request_id, "error": type(error).__name__},
            )
            reply = self.reply(
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
        self.count("dead_letter", req)
        await self._dead_letters.record(record, error)
