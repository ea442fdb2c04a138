"""The controller's telemetry agents and the reaction path they start.

The ``route`` agent reads ``llm.telemetry``, skips (and counts) what no worker MACed
(``hop_signing``, the ``telemetry`` hop), dead-letters what cannot be decoded and
makes sure each record is decided by the instance that owns its pool: one controller
instance sees all of a pool's workers and decides for the pool and for them (scale-out
is faust's: more instances share the partitions). seawall's workers key their telemetry
by pool, so a record normally sits on its pool's partition already; faust assigns the
same partition of every topic with as many partitions to the same instance
(co-partitioning), so ``route`` decides such a record itself (``direct``). Any other
record (another producer's key, or a telemetry topic with another partition count) is
forwarded to the app's internal topic, keyed by pool, where the ``decide`` agent reads
it. Deciding feeds the record to that pool's ``PoolDecider``, publishes what it decided
and asks the ``Ticker`` to react in the pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from faust.types import StreamT, TopicT

from schemas import TelemetryEvent
from seawall_client.clock import Clock
from seawall_client.serde import TELEMETRY, DecodeError, decode
from services.common.deadletters import DeadLetters, failure_of
from services.common.failures import is_infrastructure
from services.common.hop_signing import HopKey, lacks_mac
from services.controller import metrics as m
from services.controller.pools import Pools
from services.controller.ticks import Ticker

log = logging.getLogger(__name__)


def _header_list(headers: Any) -> list[tuple[str, bytes]]:
    """faust hands a record's headers on as the client gave them (aiokafka: pairs) or
    as a mapping: the pairs either way."""
    if headers is None:
        return []
    if isinstance(headers, Mapping):
        return list(headers.items())
    return list(headers)


class TelemetryAgents:
    """The ``route`` and ``decide`` agents' bodies (registered on the app by the shell)."""

    def __init__(
        self,
        pools: Pools,
        by_pool: TopicT,
        ticker: Ticker,
        dead_letters: DeadLetters,
        lock: asyncio.Lock,
        clock: Clock,
        hop: HopKey | None = None,
    ) -> None:
        self._hop = hop
        """Checks that a record on ``llm.telemetry`` was written by a worker
        (``hop_signing``, the ``telemetry`` hop); one that was not is skipped, counted."""
        self._pools = pools
        self._by_pool = by_pool
        self._ticker = ticker
        self._dead_letters = dead_letters
        self._lock = lock
        self._clock = clock
        self.direct = False
        """Whether ``route`` may decide records on their pool's partition itself."""

    async def route(self, stream: StreamT[bytes]) -> None:
        async for event in stream.events():
            message = event.message
            if lacks_mac(self._hop, message.topic, event.value, _header_list(message.headers)):
                continue
            try:
                telemetry = decode(TELEMETRY, event.value)
            except DecodeError as e:
                m.TELEMETRY.labels("unknown", "invalid").inc()
                await self._dead_letter(message, event.value, e)
                continue
            if self.direct and message.partition == self._pools.partition(telemetry.pool):
                await self._observe(telemetry, message, event.value)  # on its pool's partition
            else:
                await self._by_pool.send(key=telemetry.pool.encode(), value=event.value)

    async def decide(self, stream: StreamT[bytes]) -> None:
        async for event in stream.events():
            try:
                telemetry = decode(TELEMETRY, event.value)
            except DecodeError as e:  # only the route agent writes here; never expected
                log.error(
                    "skipped an invalid record of the internal topic", extra={"reason": e.reason}
                )
                continue
            await self._observe(telemetry, event.message, event.value)

    async def _observe(self, telemetry: TelemetryEvent, message: Any, value: bytes) -> None:
        """Decide one record. One that the policy code cannot take (a bug, or values no
        test foresaw) is dead-lettered, never allowed to stop the agent; only the
        broker being unavailable is raised (faust then restarts the agent)."""
        try:
            async with self._lock:
                now = self._clock.time()
                decider = self._pools.decider(telemetry.pool, now)
                output = decider.observe(telemetry, now)
                await self._pools.publish(decider, output)
                self._ticker.touch(telemetry.pool)
        except Exception as e:
            if is_infrastructure(e):
                raise
            log.error("a telemetry record failed", extra={"error": type(e).__name__})
            m.TELEMETRY.labels(telemetry.type, "failed").inc()
            await self._dead_letter(message, value, e)
            return
        m.count_output(telemetry.type, output)

    async def _dead_letter(self, message: Any, value: bytes | None, error: Exception) -> None:
        reason, text = failure_of(error)
        await self._dead_letters.send(
            source_topic=message.topic,
            partition=message.partition,
            offset=message.offset,
            key=message.key,
            value=value,
            reason=reason,
            error=text,
        )
