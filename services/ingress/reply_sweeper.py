"""The reply-topic sweeper: deletes the reply topics (``llm.reply.*``) that nothing was
written to for ``idle_s`` — neither a reply nor its owner's heartbeat — so that a
killed client or ingress instance does not leave its topic behind for ever. An owner
that closes cleanly deletes its own (``seawall_client.reply_upkeep``).

How a topic is judged idle: every ``every_s`` (five minutes), the sweeper reads each
reply topic's end offset (``topic_activity``; one metadata and one ListOffsets request
for all of them) and keeps, in a Redis hash, the offset, since when it has not moved,
and when it was checked. A topic whose offset has not moved for ``idle_s`` (three hours)
by the sweeper's own observation is deleted: a live owner writes a heartbeat every few
minutes, so its topic's offset always moves. The record timestamps are not used (they
are the producers' clocks); a topic seen for the first time, or after a gap in the
sweeps longer than three rounds (the sweepers were down, their memory lost), starts
its wait afresh: a lost memory only delays a deletion, it never causes one.

- One ingress replica sweeps per round: a Redis lease (``SET NX PX``) taken for a
  little less than the round.
- At most ``max_deletions`` topics per sweep, the longest idle first; the rest wait for
  the next round.
- Never this instance's own topic, and never a topic outside this stack's prefix.
- A sweep that fails (the broker or Redis away) is skipped and logged; the next round
  tries again. The sweeper never stops ingress: it serves without it.
- The race left: an owner silent for ``idle_s`` (a process stopped for hours, not dead)
  may find its topic gone when it resumes; its replies are then dead-lettered as
  ``reply_topic_unreachable`` until it starts again.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Collection
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiokafka.errors import KafkaError
from prometheus_client import Counter

from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.kafka import DELETE_TIMEOUT_S, KafkaConfig, delete_topics, topic_activity
from seawall_client.topics import RedisKeys, Topics
from services.common.failures import is_infrastructure
from services.common.lifecycle import Component

log = logging.getLogger(__name__)

SWEPT = Counter(
    "seawall_reply_topics_swept_total",
    "Reply topics the sweeper deleted, their owners gone and nothing written for hours",
)
GAP_ROUNDS = 3
"""A topic last checked more than this many rounds ago starts its idle wait afresh."""


@dataclass(frozen=True, slots=True)
class Seen:
    """What the sweeper knows of one topic (one field of the Redis hash)."""

    end: int
    """The sum of its partitions' end offsets."""
    since_ms: int
    """Since when (Unix ms) ``end`` has been what it is."""
    checked_ms: int
    """When it was last looked at."""

    def encode(self) -> str:
        return f"{self.end}:{self.since_ms}:{self.checked_ms}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Seen | None:
        text = raw.decode() if isinstance(raw, bytes) else raw
        try:
            end, since_ms, checked_ms = (int(part) for part in text.split(":"))
        except ValueError:
            return None
        return cls(end, since_ms, checked_ms)


class ReplyTopicSweeper(Component):
    """Deletes idle reply topics (module notes); ``sweep`` is one round."""

    name = "reply-sweeper"

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: Topics,
        keys: RedisKeys,
        redis: aioredis.Redis,
        *,
        holder: str,
        every_s: float,
        idle_s: float,
        max_deletions: int,
        keep: Collection[str] = (),
        delete_timeout_s: float = DELETE_TIMEOUT_S,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__()
        self._kafka = kafka
        self._prefix = topics.reply("")
        self._keys = keys
        self._redis = redis
        self._holder = holder
        self._every_s = every_s
        self._idle_ms = int(idle_s * 1000)
        self._max_deletions = max_deletions
        self._keep = frozenset(keep)
        self._delete_timeout_s = delete_timeout_s
        self._clock = clock
        self._rng = rng or random.Random()

    async def on_start(self) -> None:
        self.spawn(self._run(), "sweep")

    async def _run(self) -> None:
        # Replicas started together spread their first rounds over one interval.
        await asyncio.sleep(self._every_s * self._rng.uniform(0.1, 1.0))
        while True:
            try:
                await self.sweep()
            except Exception as e:  # the next round tries again; serving goes on meanwhile
                if is_infrastructure(e) or isinstance(e, TimeoutError):
                    log.warning("reply topic sweep skipped", extra={"error": type(e).__name__})
                else:
                    log.exception("reply topic sweep failed")
            await asyncio.sleep(self._every_s)

    async def sweep(self) -> list[str]:
        """One round, if this replica holds the lease: the topics deleted."""
        lease_ms = max(1, int(self._every_s * 900))
        if not await self._redis.set(
            self._keys.reply_sweep_lease(), self._holder, nx=True, px=lease_ms
        ):
            return []
        activity = await topic_activity(self._kafka, self._prefix)
        now_ms = int(self._clock.time() * 1000)
        gap_ms = int(GAP_ROUNDS * self._every_s * 1000)
        memory_key = self._keys.reply_topics_seen()
        known: dict[str, Seen | None] = {
            (k.decode() if isinstance(k, bytes) else k): Seen.decode(v)
            for k, v in (await self._redis.hgetall(memory_key)).items()
        }
        fresh: dict[str, str] = {}
        idle: list[tuple[int, str]] = []
        for topic, end in activity.items():
            prior = known.get(topic)
            if prior is None or prior.end != end or now_ms - prior.checked_ms > gap_ms:
                fresh[topic] = Seen(end, now_ms, now_ms).encode()
                continue
            fresh[topic] = Seen(end, prior.since_ms, now_ms).encode()
            if now_ms - prior.since_ms >= self._idle_ms and topic not in self._keep:
                idle.append((prior.since_ms, topic))
        idle.sort()
        doomed = [topic for _, topic in idle[: self._max_deletions]]
        gone: list[str] = []
        if doomed:
            try:
                gone = await delete_topics(self._kafka, doomed, self._delete_timeout_s)
            except (KafkaError, OSError, TimeoutError) as e:
                log.warning("idle reply topics not deleted", extra={"error": type(e).__name__})
        for topic in gone:
            fresh.pop(topic, None)
        forgotten = [topic for topic in known if topic not in fresh]
        if fresh:
            await self._redis.hset(memory_key, mapping=fresh)  # type: ignore[arg-type]  # invariant keys
        if forgotten:
            await self._redis.hdel(memory_key, *forgotten)
        if gone:
            SWEPT.inc(len(gone))
            log.info(
                "idle reply topics deleted",
                extra={"deleted": len(gone), "idle": len(idle), "reply_topics": len(activity)},
            )
        return gone
