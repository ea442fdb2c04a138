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

This module is the shell: it owns the clients (producer, Redis), the engine and the
lifecycle (start, drain, stop), and wires the parts, one module each:

- *fetching* (``fetching``): the dispatch consumer; records fetched while there is
  room under the batch limit; stepping aside and rejoining; commits.
- *serving* (``serving``): one task per record, from its claim to its terminal reply;
  the requests and runs in hand are shared state (``runs``).
- *answers* (``answers``): terminal replies delivered, the claim marked done, the
  outcome counted and a ``RequestCompleted`` sent; failures answered or dead-lettered.
- *leases* (``leases``): claiming, renewing and releasing requests in Redis.
- *shadows* (``shadowing``): shadows sent once answered, and run when taken.
- *control* (``control_reactions``): batch limits, breakers and profile requests.
- *telemetry* (``telemetry``): the report each interval, and the heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import close, ensure_topics
from seawall_client.topics import RedisKeys
from services.common.bus import make_producer, topics_of
from services.common.control import ControlFollower
from services.common.control_state import ControlState
from services.common.deadletters import DeadLetters
from services.common.delivery import Replies, TopicDirectory
from services.common.lifecycle import Component, cancel_tasks
from services.common.offsets import OffsetTracker
from services.common.redisclient import make_redis
from services.workers import metrics as m
from services.workers.answers import Answers
from services.workers.claims import Claims
from services.workers.control_reactions import ControlReactions
from services.workers.engine.base import Engine, EngineError
from services.workers.engine.validate import validate_limits
from services.workers.fetching import Fetching
from services.workers.gpu import GpuProbe
from services.workers.leases import Leases
from services.workers.policy.summary import RequestSummarizer
from services.workers.runs import InHand
from services.workers.serving import Serving
from services.workers.settings import WorkerSettings
from services.workers.shadowing import Shadowing
from services.workers.telemetry import Status, Telemetry

log = logging.getLogger(__name__)


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
        self._in_hand = InHand(settings.batch_limit)
        self.started_at = clock.time()
        self.incarnation = uuid.uuid4().hex[:16]
        """This process: an emergency restart names it (``WorkerHeartbeat``)."""
        self._producer = make_producer(settings)
        self._reactions = ControlReactions(
            settings=settings,
            engine=engine,
            control=self.control,
            producer=self._producer,
            topics=self.topics,
            in_hand=self._in_hand,
            incarnation=self.incarnation,
            set_batch_limit=self.set_batch_limit,
            spawn=self.spawn,
            fail=self._fail,
            clock=clock,
        )
        self._follower = ControlFollower(
            settings,
            self.topics.control,
            self.control,
            self._reactions.on_control,
            on_expire=self._reactions.on_control,
        )
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
        self._status: Status = "starting"
        summary = RequestSummarizer(self.started_at)
        self._telemetry = Telemetry(
            settings=settings,
            producer=self._producer,
            topics=self.topics,
            engine=engine,
            probe=probe,
            in_hand=self._in_hand,
            summary=summary,
            started_at=self.started_at,
            incarnation=self.incarnation,
            status=lambda: self._status,
            partitions=lambda: self.partitions,
            clock=clock,
        )
        shadowing = Shadowing(
            settings=settings,
            engine=engine,
            producer=self._producer,
            topics=self.topics,
            summary=summary,
            partitions=lambda: self.partitions,
            clock=clock,
        )
        self._leases = Leases(
            claims=self.claims,
            engine=engine,
            in_hand=self._in_hand,
            lease_s=settings.claim_lease_s,
            spawn=self.spawn,
            clock=clock,
        )
        answers = Answers(
            settings=settings,
            topics=self.topics,
            replies=self._replies,
            dead_letters=self._dead_letters,
            claims=self.claims,
            in_hand=self._in_hand,
            summary=summary,
            publish=self._telemetry.publish,
            shadowing=shadowing,
            clock=clock,
        )
        self._serving = Serving(
            settings=settings,
            engine=engine,
            replies=self._replies,
            dead_letters=self._dead_letters,
            offsets=self.offsets,
            in_hand=self._in_hand,
            answers=answers,
            leases=self._leases,
            shadowing=shadowing,
            fail=self._fail,
            clock=clock,
        )
        self._fetching = Fetching(
            settings=settings,
            topics=self.topics,
            offsets=self.offsets,
            in_hand=self._in_hand,
            isolated=lambda: self._reactions.isolated,
            serve=self._serving.serve,
            spawn=self.spawn,
        )
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
        self._in_hand.batch_limit = min(self._in_hand.batch_limit, limits.max_num_seqs)
        m.BATCH_LIMIT.labels(self.settings.pool).set(self.batch_limit)
        specs = self.topics.specs()
        if self.settings.pool not in self.topics.pools:  # a canary's, or one not configured
            specs.append(self.topics.dispatch_spec(self.settings.pool))
        await ensure_topics(self.settings.kafka, specs)
        await self._producer.start()
        await self._follower.start()
        await self._fetching.start()
        self._status = "serving"
        self._fetcher = self.spawn(self._fetching.loop(), "fetch")
        self._background = {
            self.spawn(self._fetching.commit_loop(), "commit"),
            self.spawn(self._leases.loop(), "leases"),
            self.spawn(self._telemetry.loop(), "telemetry"),
            self.spawn(self._watch(self._follower), "watch:control"),
            self.spawn(self._watch_engine(), "watch:engine"),
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

    async def _watch_engine(self) -> None:
        """Fail the worker when its engine has produced nothing for ``engine_stall_s``
        while holding requests: a hung engine is replaced, not waited on (its requests
        go to the next owner once the process is gone)."""
        limit = self.settings.engine_stall_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            stalled = self._in_hand.stalled_s(self.clock.monotonic())
            m.ENGINE_STALLED.labels(self.settings.pool).set(stalled)
            if stalled > limit:
                held = self._in_hand.generating
                log.error("engine hung", extra={"stalled_s": round(stalled, 1), "requests": held})
                self._fail(
                    EngineError(
                        f"the engine produced no token for {stalled:.0f} s with {held} "
                        "requests in it"
                    )
                )
                return

    @staticmethod
    async def _watch(part: Component) -> None:
        await part.failed.wait()
        raise RuntimeError(f"{part.name} failed") from part.failure

    async def on_stop(self) -> None:
        self._status = "draining"
        self._fetching.draining = True
        async with self._in_hand.capacity:
            self._in_hand.capacity.notify_all()
        if self._fetcher is not None:
            await cancel_tasks({self._fetcher})
        pending = set(self._in_hand.requests.values())
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
            await self._fetching.commit_done()
        finally:
            self._status = "stopped"
            # The last heartbeat is a courtesy: a broker already gone must not turn a
            # clean stop into a failure.
            with contextlib.suppress(KafkaError, OSError):
                await self._telemetry.publish_heartbeat()
            await self._fetching.close()
            await self._follower.stop()
            await close(self._producer)
            await self._redis.aclose()
            await self.engine.stop()
            self.probe.close()

    def set_batch_limit(self, limit: int) -> None:
        new = max(1, min(limit, self.engine.limits.max_num_seqs))
        if new != self.batch_limit:
            log.info("batch limit changed", extra={"previous": self.batch_limit, "limit": new})
        self._in_hand.batch_limit = new
        m.BATCH_LIMIT.labels(self.settings.pool).set(new)
        self.spawn(self._in_hand.notify(), "notify")

    def _fail(self, error: BaseException) -> None:
        """Fail the worker: the process exits and its supervisor restarts it."""
        self.failure = error
        self.failed.set()

    @property
    def batch_limit(self) -> int:
        return self._in_hand.batch_limit

    @property
    def prefill_pending_tokens(self) -> int:
        return self._in_hand.prefill_pending_tokens

    @property
    def in_flight(self) -> int:
        return self._in_hand.in_flight

    @property
    def stepped_aside(self) -> bool:
        """Out of the consumer group because its breaker isolates it."""
        return self._fetching.stepped_aside

    @property
    def partitions(self) -> frozenset[TopicPartition]:
        """The dispatch partitions the group gave this worker."""
        return self._fetching.partitions
