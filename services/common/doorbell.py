"""A doorbell per topic, over Redis pub/sub, for a broker that answers waiting fetches
late (the embedded Tansu broker; off for Apache Kafka, which answers at once).

Tansu holds a fetch that finds nothing and looks again only after sleeping half of its
remaining wait: a record written meanwhile waits for that look (its ``fetch.rs``; half
the fetch wait at worst, measured 4 ms median at 50 ms and 43 ms at 500). So an idle
consumer either polls the broker many times a second or delays the first record after
a quiet spell. With a doorbell it does neither: every producer built by
``services.common.bus`` rings a topic's channel (``<redis prefix>doorbell:<topic>``)
once the broker has acknowledged a record on it, and every consumer that reads the
topic wakes (``seawall_client.kafka.Consumer.wake``): dormant between rings, with no
fetch at the broker, it fetches at once and its first look finds the record
(``seawall_client.fetch_pacing.Dormancy``).

- Rings are coalesced: one ``PUBLISH`` per topic per turn of the event loop, sent in one
  pipeline. Topics nobody wakes on are not rung: a client's own reply topic (the SDK
  reads it without Redis) and the dead letters.
- A process subscribes to the channels of the topics its consumers read, as they learn
  them, on one pub/sub connection.
- Nothing depends on a ring arriving: a lost one (Redis unreachable, a producer outside
  seawall such as an SDK client on ``llm.ingress``, whose consumer is therefore never
  dormant) costs the reader at most its ``Dormancy.peek_s``. Redis failing is logged,
  retried with backoff, and never fails a send or a read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import weakref
from collections.abc import Iterable
from typing import Any, ClassVar, Final

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.exceptions import RedisError

from seawall_client.kafka import Consumer
from services.common.failures import Backoff
from services.common.redisclient import cluster_node_url

log = logging.getLogger(__name__)

WARN_EVERY_S: Final = 30.0
LISTEN_TIMEOUT_S: Final = 0.25
"""How long the listener waits for a ring before it looks whether its consumers' topics
changed (a new one's channel is subscribed within this)."""
_CLIENT_REPLY = re.compile(r"llm\.reply\.[0-9a-f]{12}\.")
"""An SDK client's reply topic (``llm.reply.<key id>.<owner>``): read without Redis."""
_NEVER_RUNG = ("llm.deadletter", "llm.audit", "llm.alerts")

RINGS = Counter("seawall_doorbell_rings_total", "Topics rung (one PUBLISH each)")
WAKES = Counter("seawall_doorbell_wakes_total", "Sleeping consumers woken by a ring")


class Doorbell:
    """The rings and the wake-ups of one process, for one Redis (``shared``)."""

    _instances: ClassVar[
        weakref.WeakValueDictionary[tuple[str, str, asyncio.AbstractEventLoop], Doorbell]
    ] = weakref.WeakValueDictionary()

    def __init__(
        self, redis_url: str, prefix: str, credentials: dict[str, str] | None = None
    ) -> None:
        self._redis_url = redis_url
        self._credentials = credentials or {}
        self._prefix = f"{prefix}doorbell:"
        self._redis: aioredis.Redis | None = None
        self._pending: set[str] = set()
        self._flushing = False
        self._consumers: weakref.WeakSet[Consumer] = weakref.WeakSet()
        self._wanted: set[str] = set()
        self._subscribed: set[str] = set()
        self._listener: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._last_warning = -WARN_EVERY_S

    @classmethod
    def shared(
        cls, redis_url: str, prefix: str, credentials: dict[str, str] | None = None
    ) -> Doorbell:
        """This event loop's doorbell for ``redis_url`` and ``prefix``, logged in with
        ``credentials`` (``CommonSettings.redis_credentials``)."""
        key = (redis_url, prefix, asyncio.get_running_loop())
        found = cls._instances.get(key)
        if found is None:
            found = cls._instances[key] = cls(redis_url, prefix, credentials)
        return found

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            # On a Redis Cluster, the node the URL names: a PUBLISH on any node reaches
            # the subscribers of every node (the cluster bus carries it).
            url = cluster_node_url(self._redis_url) or self._redis_url
            self._redis = aioredis.Redis.from_url(
                url,
                socket_timeout=1.0,
                socket_connect_timeout=1.0,
                username=self._credentials.get("username"),
                password=self._credentials.get("password"),
            )
        return self._redis

    def _warn(self, what: str, error: BaseException) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() - self._last_warning >= WARN_EVERY_S:
            self._last_warning = loop.time()
            log.warning(
                f"doorbell: {what}; readers fall back on their peeks",
                extra={"error": repr(error)[:200]},
            )

    # -- ringing ---------------------------------------------------------------------
    def ring(self, topic: str) -> None:
        """Say that ``topic`` has a new record (its ack came back). Sent with the other
        rings of this turn of the event loop."""
        if topic.endswith(_NEVER_RUNG) or _CLIENT_REPLY.search(topic):
            return
        self._pending.add(topic)
        if not self._flushing:
            self._flushing = True
            self._spawn(self._flush())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(0)  # the rest of this turn's rings join
            while self._pending:
                topics, self._pending = self._pending, set()
                try:
                    async with self._client().pipeline(transaction=False) as pipe:
                        for topic in topics:
                            pipe.publish(self._prefix + topic, b"")
                        await pipe.execute()
                    RINGS.inc(len(topics))
                except (RedisError, OSError) as e:
                    self._warn("could not ring", e)
        finally:
            self._flushing = False

    # -- waking ----------------------------------------------------------------------
    def watch(self, consumer: Consumer) -> None:
        """Wake ``consumer`` whenever a topic it reads is rung (until it stops)."""
        self._consumers.add(consumer)
        consumer.on_topics = self._topics_of_consumers_changed
        consumer.on_stopped = self.unwatch
        self._topics_of_consumers_changed(consumer.topics_read)

    def unwatch(self, consumer: Consumer) -> None:
        self._consumers.discard(consumer)
        self._topics_of_consumers_changed()
        if not self._consumers and self._listener is not None:
            self._listener.cancel()
            self._listener = None

    def _topics_of_consumers_changed(self, _: Iterable[str] = ()) -> None:
        wanted = {t for c in self._consumers for t in c.topics_read}
        if wanted == self._wanted:
            return
        self._wanted = wanted
        if wanted and (self._listener is None or self._listener.done()):
            self._listener = asyncio.get_running_loop().create_task(self._listen(), name="doorbell")

    async def _listen(self) -> None:
        backoff = Backoff()
        while True:
            pubsub = self._client().pubsub(ignore_subscribe_messages=True)
            try:
                self._subscribed = set()
                while True:
                    await self._sync(pubsub)
                    message = await pubsub.get_message(timeout=LISTEN_TIMEOUT_S)
                    if message is not None:
                        self._deliver(message)
                    backoff.reset()
            except (RedisError, OSError) as e:
                self._warn("not listening", e)
                await backoff.wait()
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    async def _sync(self, pubsub: Any) -> None:
        if self._subscribed == self._wanted:
            return
        wanted = set(self._wanted)
        new, gone = wanted - self._subscribed, self._subscribed - wanted
        if new:
            await pubsub.subscribe(*(self._prefix + t for t in new))
        if gone:
            await pubsub.unsubscribe(*(self._prefix + t for t in gone))
        self._subscribed = wanted
        # What was written before the subscription took effect is not rung to us.
        for consumer in list(self._consumers):
            consumer.wake()

    def _deliver(self, message: dict[str, Any]) -> None:
        channel = message.get("channel")
        if not isinstance(channel, bytes):
            return
        topic = channel.decode(errors="replace")[len(self._prefix) :]
        for consumer in list(self._consumers):
            if topic in consumer.topics_read:
                WAKES.inc()
                consumer.wake()
