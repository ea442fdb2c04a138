"""What the worker does when a control decision for it changes or expires.

``ControlFollower`` (``services.common.control``; wired by the service) keeps the latest
control event per key; a decision that expires falls back to the default. Its changes
land here, level-triggered (what is in force now is applied): a ``BatchLimit`` sets the
batch limit (the setting again once it expires); the worker's ``BreakerState`` says
whether it is isolated (the shell's fetch loop steps aside or rejoins) and, at the
emergency level and naming this process, orders a restart; a ``Profile`` request runs
the engine's profiler (``profiling``) and answers on the control topic.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka import AIOKafkaProducer

from schemas import BatchLimit, BreakerLevel, BreakerState, ControlEvent, Profile
from seawall_client.clock import Clock
from seawall_client.topics import Topics
from services.common.consuming import retry_unavailable
from services.common.control_signing import send_signed, signer_for
from services.common.control_state import ControlState, isolates
from services.common.failures import Backoff
from services.workers.engine.base import Engine
from services.workers.profiling import Profiles, answer
from services.workers.runs import InHand
from services.workers.settings import WorkerSettings

log = logging.getLogger(__name__)


class ControlReactions:
    """The follower's callback (``on_control``), on a change and on an expiry."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        engine: Engine,
        control: ControlState,
        producer: AIOKafkaProducer,
        topics: Topics,
        in_hand: InHand,
        incarnation: str,
        set_batch_limit: Callable[[int], None],
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
        fail: Callable[[BaseException], None],
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.worker_id = settings.instance_id
        self.engine = engine
        self.control = control
        self._producer = producer
        self._signer = signer_for(settings, "worker")
        """Signs this worker's answers to profiling requests (the workers' principal)."""
        self.topics = topics
        self._in_hand = in_hand
        self.incarnation = incarnation
        self.set_batch_limit = set_batch_limit
        self.spawn = spawn
        self._fail = fail
        self.clock = clock
        self.profiles = Profiles(self.worker_id)
        self.isolated = False
        """What the latest breaker event for this worker says."""

    def on_control(self, event: ControlEvent) -> None:
        """A decision changed or expired: apply what is in force now (level-triggered)."""
        scope = f"worker:{self.worker_id}"
        if isinstance(event, Profile) and self.profiles.take(event, self.clock.time()):
            self.spawn(self._profile(event), f"profile:{event.request}")
        if isinstance(event, BatchLimit) and event.scope == scope:
            current = self.control.get(BatchLimit, scope)
            self.set_batch_limit(self.settings.batch_limit if current is None else current.limit)
        if isinstance(event, BreakerState) and event.scope == scope:
            breaker = self.control.get(BreakerState, scope)
            self.isolated = (
                self.settings.leave_group_when_isolated
                and breaker is not None
                and isolates(breaker)
            )
            self.spawn(self._in_hand.notify(), "notify")  # the fetch loop acts on it
            if (
                breaker is event
                and event.level >= BreakerLevel.EMERGENCY
                and event.incarnation == self.incarnation  # not an order for another
            ):
                log.error(
                    "emergency restart ordered by the controller",
                    extra={"reason": event.evidence.reason},
                )
                self._fail(RuntimeError("emergency restart ordered by the controller"))

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
            lambda: send_signed(self._producer, self.topics.control, [event], self._signer),
            Backoff(),
            "worker-profile",
        )
