"""A reply topic's life: its owner keeps it alive with heartbeats and deletes it when it
closes; what a killed owner leaves behind is swept by ingress (``services.ingress.
reply_sweeper``) once it has been idle for hours.

- **Heartbeats**: the owner (an SDK client, an ingress instance) produces a heartbeat
  record to its own reply topic every ``heartbeat_s`` (five minutes by default), and
  one as it starts. Liveness is so written where the sweeper reads the topic's
  activity anyway, its end offset: a topic whose end offset has not moved for the
  sweeper's idle time (three hours by default) had neither replies nor an owner.
  Not a Redis key with a TTL: the SDK's clients have no Redis (they are tenants, outside
  the fleet's trust), and a Redis that lost its keys (flushed, failed over without
  persistence) would make every idle client's topic look abandoned, where a lost
  sweeper memory only makes the sweeper wait longer. The owner needs nothing it does
  not have already: it may write its own reply topics (``SECURITY.md``).
- A heartbeat is a record with an empty value and the ``seawall-heartbeat`` header;
  readers of reply topics skip it (``is_heartbeat``) before decoding.
- **Deletion on close**: the owner deletes its topic when it closes cleanly, bounded by
  a timeout (the broker being away leaves the topic to the sweeper), and only when no
  reply can still be on its way to it: nothing is awaited, and no request was given
  up on within its deadline (a request the fleet still holds would be answered into a
  topic that is gone, and on Apache Kafka its producer would wait for the topic until
  its request timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Final

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from seawall_client.kafka import DELETE_TIMEOUT_S, KafkaConfig, delete_topics

log = logging.getLogger(__name__)

HEARTBEAT_HEADER: Final = "seawall-heartbeat"
HEARTBEAT_S: Final = 300.0
"""An owner's heartbeat interval by default: a thirty-sixth of the sweeper's default
idle time (``reply_idle_s``, three hours), so that a few missed beats (a broker away, a
laptop asleep) lose nothing."""


def is_heartbeat(headers: Iterable[tuple[str, bytes]] | None) -> bool:
    """Whether a reply-topic record is its owner's heartbeat (no reply: skip it)."""
    return headers is not None and any(name == HEARTBEAT_HEADER for name, _ in headers)


async def beat(producer: AIOKafkaProducer, topic: str) -> None:
    """One heartbeat on ``topic``, acknowledged by the broker."""
    await producer.send_and_wait(topic, b"", headers=[(HEARTBEAT_HEADER, b"1")])


async def keep_alive(producer: AIOKafkaProducer, topic: str, every_s: float) -> None:
    """A heartbeat every ``every_s`` until cancelled; one that fails (the broker away)
    is logged and the next one is tried on time."""
    while True:
        await asyncio.sleep(every_s)
        try:
            async with asyncio.timeout(every_s):
                await beat(producer, topic)
        except (KafkaError, TimeoutError) as e:
            log.warning(
                "reply topic heartbeat failed", extra={"topic": topic, "error": type(e).__name__}
            )


async def delete_own(config: KafkaConfig, topic: str, timeout_s: float = DELETE_TIMEOUT_S) -> bool:
    """Delete the owner's reply topic within ``timeout_s``; whether it is gone. A
    failure is logged, not raised: the sweeper deletes the topic once it is idle."""
    try:
        gone = topic in await delete_topics(config, [topic], timeout_s)
    except (KafkaError, OSError, TimeoutError) as e:
        log.warning(
            "reply topic not deleted; the sweeper will",
            extra={"topic": topic, "error": type(e).__name__},
        )
        return False
    return gone
