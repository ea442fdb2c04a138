"""Delivering replies to the topic a record named — written once, for ingress,
admission and workers.

A record's ``reply_to`` is chosen by whoever produced it, so before anything is sent
there it must be a reply topic (``<prefix>llm.reply.<owner>``; never the control topic
or a priority topic a record merely names) and it must exist. Reply topics are created
by their owner (the SDK client or ingress instance that reads them); a service never
creates one by producing to it, which the embedded broker would do (it auto-creates on
produce) and a production Kafka with auto-creation off would answer only after the
producer's metadata wait ran out. ``TopicDirectory`` reads the broker's topic list with
a metadata request that creates nothing.

A reply that cannot be delivered raises ``Undeliverable`` (a ``DecodeError``: it is the
record's own failure, and the caller dead-letters the record with its reason), and is
counted in ``seawall_replies_undeliverable_total``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from prometheus_client import Counter
from pydantic import BaseModel

from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.serde import DecodeError, encode
from seawall_client.topics import Topics
from services.common.failures import StoreUnavailable

UNDELIVERABLE = Counter(
    "seawall_replies_undeliverable_total",
    "Replies not sent because their reply_to is no reply topic or does not exist",
    ["reason"],
)


class Undeliverable(DecodeError):
    """A reply's topic is not a reply topic (``invalid_reply_to``) or does not exist
    (``reply_topic_unreachable``)."""


class TopicDirectory:
    """Which topics exist. A name seen once stays known; a name not known costs one
    metadata listing, shared by every lookup waiting at the time and never more often
    than every ``min_interval_s``, so a flood of records naming made-up topics costs
    the broker a bounded number of requests."""

    def __init__(
        self, producer: AIOKafkaProducer, min_interval_s: float = 0.05, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._producer = producer
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._names: set[str] = set()
        self._listed_at = -float("inf")
        """When the listing that gave ``_names`` was asked for."""
        self._listing: asyncio.Task[None] | None = None

    async def exists(self, topic: str) -> bool:
        if topic in self._names:
            return True
        asked = self._clock.monotonic()
        while self._listed_at < asked:
            if self._listing is None or self._listing.done():
                self._listing = asyncio.create_task(self._list(), name="topic-directory")
            await asyncio.shield(self._listing)
        return topic in self._names

    async def _list(self) -> None:
        wait = self._listed_at + self._min_interval_s - self._clock.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        started = self._clock.monotonic()
        try:
            cluster = await self._producer.client.fetch_all_metadata()
        except KafkaError as e:
            raise StoreUnavailable(f"the broker did not list its topics ({e})") from e
        self._names |= set(cluster.topics())
        self._listed_at = started


class Replies:
    """Sends replies (chunks and terminal replies) to the reply topics records name."""

    def __init__(self, producer: AIOKafkaProducer, topics: Topics, directory: TopicDirectory):
        self._producer = producer
        self._prefix = topics.reply("")
        self.directory = directory

    def check_name(self, reply_to: str) -> None:
        """Raise ``Undeliverable`` unless ``reply_to`` names a reply topic (no I/O)."""
        if not reply_to.startswith(self._prefix) or reply_to == self._prefix:
            UNDELIVERABLE.labels("invalid_reply_to").inc()
            raise Undeliverable(
                "invalid_reply_to", f"reply_to must name a reply topic ('{self._prefix}*')"
            )

    async def check(self, reply_to: str) -> None:
        """Raise ``Undeliverable`` unless ``reply_to`` is an existing reply topic."""
        self.check_name(reply_to)
        if not await self.directory.exists(reply_to):
            UNDELIVERABLE.labels("reply_topic_unreachable").inc()
            raise Undeliverable(
                "reply_topic_unreachable", f"the reply topic {reply_to!r} does not exist"
            )

    async def check_many(self, reply_tos: Iterable[str]) -> dict[str, Undeliverable | None]:
        """``check`` for many topics at once (one listing for all the unknown ones):
        per topic, the ``Undeliverable`` it would raise, or ``None``."""
        names = set(reply_tos)
        results = await asyncio.gather(*(self.check(t) for t in names), return_exceptions=True)
        found: dict[str, Undeliverable | None] = {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, Undeliverable):
                found[name] = result
            elif isinstance(result, BaseException):
                raise result
            else:
                found[name] = None
        return found

    async def send(self, reply_to: str, message: BaseModel, key: str) -> asyncio.Future[Any]:
        """Queue ``message`` on ``reply_to``; await the result for the broker's ack.
        Raises ``Undeliverable`` (see ``check``) before sending anything."""
        await self.check(reply_to)
        future: asyncio.Future[Any] = await self._producer.send(
            reply_to, encode(message), key=key.encode()
        )
        return future
