"""Admission's terminal answers: replies and dead letters.

A request refused (by ``AdmissionPolicy.screen``, ``judge`` or ``release``), shed, expired or
failed on its own account (answered ``error``) gets its reply on its ``reply_to``; a
record that does not decode, or whose ``reply_to`` is not an existing reply topic, is
dead-lettered (no quota, no GPU for what nobody can receive). Dead letters are bounded
(``services.common.deadletters``). Each is sent in the background (the service's stop
waits for them) and marks its record's offset done only once the broker has it; a reply
that turns out undeliverable is dead-lettered instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka import TopicPartition

from schemas import InferenceRequest, Priority
from seawall_client.clock import Clock
from seawall_client.serde import DecodeError, encode
from services.admission import metrics as m
from services.admission.backlog import Waiting
from services.admission.corrections import Corrections
from services.admission.policy.outcomes import Reply, failed
from services.common.consuming import Record, retry_unavailable
from services.common.deadletters import DeadLetters, failure_of
from services.common.delivery import Replies
from services.common.failures import Backoff
from services.common.offsets import OffsetTracker

log = logging.getLogger(__name__)


class Answers:
    """Answers and dead-letters records of the priority topics, off the loops."""

    def __init__(
        self,
        replies: Replies,
        dead_letters: DeadLetters,
        offsets: OffsetTracker[TopicPartition],
        corrections: Corrections,
        clock: Clock,
        finish: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self._replies = replies
        self._dead_letters = dead_letters
        self._offsets = offsets
        self._corrections = corrections
        self._clock = clock
        self._finish = finish

    def reply(
        self,
        tp: TopicPartition,
        offset: int,
        request: InferenceRequest,
        cls: Priority,
        verdict: Reply,
    ) -> None:
        reply = verdict.reply
        m.decided(reply.status.value, reply.reason.value, cls, request)
        self._finish(self._send_reply(tp, offset, request, verdict))

    def fail(
        self,
        tp: TopicPartition,
        offset: int,
        request: InferenceRequest,
        cls: Priority,
        error: BaseException,
    ) -> None:
        """A request whose processing failed on its own account: answered ``error``."""
        code, message = failure_of(error)
        log.error(
            "a request failed on its own account",
            extra={"request_id": request.request_id, "error": type(error).__name__},
        )
        self.reply(tp, offset, request, cls, failed(request, code, message, self._clock.time()))

    def fail_waiting(self, w: Waiting, error: BaseException) -> None:
        self.fail(w.tp, w.offset, w.request, w.source, error)
        self._corrections.refund(w)

    def refuse(
        self,
        tp: TopicPartition,
        record: Record,
        request: InferenceRequest | None,
        cls: Priority,
        error: DecodeError,
    ) -> None:
        """Dead-letter a record (``request``: ``None`` when it did not decode)."""
        m.decided("dead_letter", error.reason, cls, request)
        self._finish(self._dead_letter(tp, record, error))

    async def _send_reply(
        self, tp: TopicPartition, offset: int, request: InferenceRequest, verdict: Reply
    ) -> None:
        async def deliver() -> None:
            await (await self._replies.send(request.reply_to, verdict.reply, request.request_id))

        try:
            await retry_unavailable(deliver, Backoff(), "admission-reply")
        except Exception as e:  # undeliverable (no such reply topic), or another of its own
            reason, message = failure_of(e)
            await self._dead_letters.send(
                source_topic=tp.topic,
                partition=tp.partition,
                offset=offset,
                key=request.partition_key.encode(),
                value=encode(request),
                reason=reason,
                error=message,
            )
        self._offsets.done(tp, offset)

    async def _dead_letter(self, tp: TopicPartition, record: Record, error: DecodeError) -> None:
        await self._dead_letters.record(record, error)
        self._offsets.done(tp, record.offset)
