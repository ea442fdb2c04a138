"""What the worker has in hand, shared by its parts (state only, no I/O).

The shell's fetch loop adds a serving task per record and waits on ``capacity`` for
room under the batch limit; the serving of each request keeps its ``Run`` here while
it lasts; the lease loop renews the runs' claims; telemetry reads the counts. One
object, so that each part is handed what it shares instead of the whole worker.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import TopicPartition

from services.workers.claims import Held

CLAIM_MARGIN_S = 60.0
"""A claim outlives its request's deadline by this much."""


class Retry(Exception):
    """The broker or Redis failed mid-generation: this generation is given up, and the
    request is claimed and generated again after a backoff."""


class Run:
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


class InHand:
    """The requests in flight, the runs of them, the batch limit and what is counted
    of them so far."""

    def __init__(self, batch_limit: int) -> None:
        self.requests: dict[str, asyncio.Task[Any]] = {}
        """Record key (``partition:offset``) → the task that serves it."""
        self.runs: dict[str, Run] = {}
        """Request (``InferenceRequest.scoped_id``: ids are unique per tenant only) → the
        run of it in hand."""
        self.prefilled_tokens_total = 0
        """Prompt tokens whose first token came (``EngineStats.prefilled_tokens_total``)."""
        self.capacity = asyncio.Condition()
        self.batch_limit = batch_limit
        self.completed_total = 0
        """Requests finished so far (``RequestCompleted.seq``, reports'
        ``completed_total``)."""
        self.generating = 0
        """Requests in the engine now (between their submission and their last output)."""
        self.progressed_at = 0.0
        """When the engine last produced an output, or started on work while idle
        (monotonic)."""

    def engine_started(self, now: float) -> None:
        if self.generating == 0:
            self.progressed_at = now  # idle time is not a stall
        self.generating += 1

    def engine_done(self) -> None:
        self.generating -= 1

    def stalled_s(self, now: float) -> float:
        """How long the engine has produced nothing while it held requests (0: idle, or
        producing)."""
        return max(0.0, now - self.progressed_at) if self.generating else 0.0

    async def notify(self) -> None:
        async with self.capacity:
            self.capacity.notify_all()

    @property
    def prefill_pending_tokens(self) -> int:
        """Prompt tokens of the requests in the engine with no first token yet (what
        admission paces prefill against; engine-agnostic: counted here, not asked)."""
        return sum(r.prefill_tokens for r in self.runs.values())

    @property
    def in_flight(self) -> int:
        return len(self.requests)
