"""Admission: decides each request and dispatches admitted work at the pace pools absorb.

This module is the shell: it owns the clients (producer, consumers, Redis) and the
lifecycle, and wires the parts, one module each:

- *intake* (``intake``): the priority topics read, each batch screened, charged and
  judged; a rejection answered, an acceptance put in its class's backlog
  (``backlog``); partitions paused while their class's backlog is full; offsets
  committed once each record's effect is acknowledged.
- *dispatch* (``dispatcher``): per pool, what its free capacity holds released to
  ``llm.dispatch.<pool>``, by class; expired waiting requests swept.
- *telemetry* (``telemetry``): worker reports and completions feed the pacing rule.
- *hints* (``hint_publisher``): a tenant's empty requests bucket told to ingress.
- *corrections* (``corrections``): completions correct their tenant's tokens bucket;
  refused requests refund what they reserved.
- *control* (``control_reactions``): what changes when a control decision changes or
  expires, fed by a ``ControlFollower``.

Terminal replies and dead letters (``answers``) are sent in the background; the stop
waits for them. A part that fails fails the service: the process exits and its
supervisor restarts it.

No record stops a loop (``services.common.consuming``): a request whose reply cannot
be delivered (its ``reply_to`` is not an existing reply topic) is dead-lettered; one
that fails on its own account (too large to forward, say) is answered ``error``; the
broker or Redis being unavailable pauses the work in hand, which is tried again after
a backoff (a quota store that stays down falls back to the tiers' Redis-down policy).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import TopicPartition

from schemas import Priority
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import close, ensure_topics, start_tail
from seawall_client.topics import RedisKeys
from services.admission.answers import Answers
from services.admission.backlog import Backlog
from services.admission.control_reactions import ControlReactions
from services.admission.corrections import CompletionsHandler, Corrections
from services.admission.dispatcher import Dispatcher
from services.admission.hint_publisher import HintPublisher
from services.admission.intake import Intake
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.config import PolicyConfig
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.policy.workers import CapacityConfig
from services.admission.quota import RedisQuota
from services.admission.settings import AdmissionSettings
from services.admission.telemetry import TelemetryTail
from services.common.bus import make_consumer, make_producer, topics_of
from services.common.consuming import ConsumerLoop
from services.common.control import ControlFollower
from services.common.control_state import ControlState
from services.common.deadletters import DeadLetters
from services.common.delivery import Replies, TopicDirectory
from services.common.failures import Backoff
from services.common.hop_signing import hop_key_for
from services.common.lifecycle import Component, cancel_tasks
from services.common.offsets import OffsetTracker
from services.common.redisclient import make_redis
from services.common.sampling import sampling_secret

log = logging.getLogger(__name__)


class Admission(Component):
    name = "admission"

    def __init__(self, settings: AdmissionSettings, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__()
        self.settings = settings
        self.clock = clock
        self.topics = topics_of(settings)
        self.keys = RedisKeys(settings.redis_prefix)
        self.tiers = settings.tier_configs()
        self.control = ControlState(clock)
        self.policy = AdmissionPolicy(
            PolicyConfig(
                tiers=self.tiers,
                pools=settings.pools,
                small_pool=settings.small_pool,
                enterprise_pools=settings.enterprise_pools,
                max_tokens_cap=settings.max_tokens_cap,
                rate_limit_factor=settings.rate_limit_factor,
                breaker_retry_after_s=settings.breaker_retry_after_s,
                quota_retry_after_s=settings.quota_retry_after_s,
                scavenger_tiers=settings.scavenger_tiers,
                scavenger_wait_s=settings.scavenger_wait_s,
                scavenger_headroom=settings.scavenger_headroom,
                consistency_sample=settings.consistency_sample,
                consistency_min_similarity=settings.consistency_min_similarity,
                # keyed: a producer's ids must not pick its canary side or its shadows
                sampling_secret=sampling_secret(settings),
            )
        )
        self.capacity = FleetCapacity(
            CapacityConfig(
                worker_timeout_s=settings.worker_timeout_s,
                slack=settings.pacing_slack,
                ledger_ttl_s=settings.ledger_ttl_s,
                prefill_steps=settings.pacing_prefill_steps,
                kv_fill=settings.pacing_kv_fill,
                vip_reserve=settings.vip_reserve,
            )
        )
        self.offsets: OffsetTracker[TopicPartition] = OffsetTracker()
        self._producer = make_producer(settings)
        self._dead_letters = DeadLetters(
            self._producer, self.topics.deadletter, f"admission:{settings.instance_id}", clock
        )
        self._replies = Replies(
            self._producer, self.topics, TopicDirectory(self._producer, clock=clock)
        )
        self._redis = make_redis(settings)
        self._quota = RedisQuota(self._redis, settings.redis_prefix)
        self._loops: set[asyncio.Task[Any]] = set()
        self._finishing: set[asyncio.Task[Any]] = set()
        backoff = Backoff()  # one, shared by the intake and dispatch loops
        self._backlog = Backlog()
        self._corrections = Corrections(
            self._redis,
            self._quota,
            self.keys,
            self.policy,
            self.control,
            self.tiers,
            clock,
            self._finish,
        )
        answers = Answers(
            self._replies, self._dead_letters, self.offsets, self._corrections, clock, self._finish
        )
        hints = HintPublisher(
            self._producer,
            self.topics.quota_hints,
            self.control,
            clock,
            self._finish,
            hop=hop_key_for(settings, "hints"),
        )
        self._dispatcher = Dispatcher(
            interval_s=settings.dispatch_interval_s,
            backlog=self._backlog,
            policy=self.policy,
            control=self.control,
            capacity=self.capacity,
            producer=self._producer,
            topics=self.topics,
            redis=self._redis,
            keys=self.keys,
            offsets=self.offsets,
            answers=answers,
            corrections=self._corrections,
            backoff=backoff,
            clock=clock,
            hop=hop_key_for(settings, "dispatch"),
        )
        wake = self._dispatcher.wake
        reactions = ControlReactions(
            self.control, self.capacity, settings.rate_limit_factor, hints, wake
        )
        self._follower = ControlFollower(
            settings,
            self.topics.control,
            self.control,
            reactions.on_control,
            on_expire=reactions.on_control,
            dead_letters=self._dead_letters,
        )
        prefix = settings.topic_prefix
        self._consumer = make_consumer(settings, group_id=f"{prefix}seawall.admission")
        self._intake = Intake(
            settings=settings,
            consumer=self._consumer,
            topics=self.topics,
            keys=self.keys,
            offsets=self.offsets,
            replies=self._replies,
            quota=self._quota,
            policy=self.policy,
            control=self.control,
            capacity=self.capacity,
            backlog=self._backlog,
            answers=answers,
            corrections=self._corrections,
            hints=hints,
            backoff=backoff,
            wake=wake,
            clock=clock,
        )
        self._telemetry = make_consumer(settings, group_id=None)
        # From the earliest record where the group has no committed offset: a member
        # killed before its first commit (or before it joined) would otherwise leave the
        # completions written meanwhile behind its successor's "latest", and their
        # reservations unsettled: the tenant charged its estimate, not what it used.
        # Replaying settled ones is a no-op (settle.lua's 'take' finds nothing).
        self._completions = make_consumer(
            settings,
            self.topics.completions,
            group_id=f"{prefix}seawall.admission.completions",
            auto_offset_reset="earliest",
        )
        self._tail: ConsumerLoop[None] = ConsumerLoop(
            self._telemetry,
            TelemetryTail(
                self.capacity,
                self.topics.completions,
                clock,
                wake,
                hop_key_for(settings, "telemetry"),
            ),
            None,
            name="admission-telemetry",
            commit=False,
            concurrency=1,
            start_consumer=False,
        )
        self._settling: ConsumerLoop[None] = ConsumerLoop(
            self._completions,
            CompletionsHandler(
                self._corrections, self._dead_letters, hop_key_for(settings, "telemetry")
            ),
            None,
            name="admission-corrections",
            commit=True,
            concurrency=settings.redis_fanout,
            fetch_timeout_ms=500,
            start_consumer=False,
        )

    # -- lifecycle -------------------------------------------------------------------
    async def on_start(self) -> None:
        s = self.settings
        await ensure_topics(s.kafka, self.topics.specs())
        await self._producer.start()
        # Group joins take seconds on some brokers (Tansu delays the first JoinGroup):
        # join both groups at once.
        await asyncio.gather(
            self._follower.start(),
            start_tail(self._telemetry, self.topics.telemetry, self.topics.completions),
            self._completions.start(),
            self._consumer.start(),
        )
        await self._tail.start()
        await self._settling.start()
        self._loops = {
            self.spawn(self._intake.loop(), "intake"),
            self.spawn(self._dispatcher.loop(), "dispatch"),
            self.spawn(self._intake.commit_loop(), "commit"),
            *(self.spawn(self._watch(part), f"watch:{part.name}") for part in self._parts),
        }
        log.info("admission running", extra={"pools": ",".join(s.pools)})

    @property
    def _parts(self) -> tuple[Component, ...]:
        return (self._follower, self._tail, self._settling)

    @staticmethod
    async def _watch(part: Component) -> None:
        """Fail with a part: the process exits and its supervisor restarts it."""
        await part.failed.wait()
        raise RuntimeError(f"{part.name} failed") from part.failure

    async def on_stop(self) -> None:
        await cancel_tasks(self._loops)
        self._backlog.drain()
        if self._finishing:
            await asyncio.wait(self._finishing, timeout=self.settings.shutdown_grace_s)
        try:
            # ``waiting`` is not committed: the next owner decides it again, replaying its
            # charge, so its tokens stay reserved for it (``corrections``).
            await self._intake.commit_done()
        finally:
            for part in self._parts:
                await part.stop()
            for consumer in (self._consumer, self._completions, self._telemetry):
                await close(consumer)
            await close(self._producer)
            await self._redis.aclose()

    def backlog(self, cls: Priority) -> int:
        """Accepted requests waiting in class ``cls``."""
        return self._backlog.count(cls)

    def _finish(self, coro: Any) -> None:
        """Send a terminal reply, dead letter, hint or refund in the background: the
        stop waits for it (within the grace period)."""
        task = self.spawn(coro, "finish")
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)
