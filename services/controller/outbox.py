"""Group commit of the controller's control events.

A decision must not be published before the record that holds it is durable in the
changelog (a restarted controller would otherwise restore a state older than one it
published). Flushing the changelog for each decision costs a broker round trip per
decision, and the agent that decides would wait for it every time: with a thousand
workers warming up their batch limits, those waits alone were the controller's limit.

Here the deciders ``put`` events (their records already handed to the changelog's
producer) and go on; one publisher task takes everything pending, flushes the changelog
once for all of it, then publishes it in the order it was put. Nothing waits when
nothing is pending, so a lone decision is not delayed; under load the round trip is
shared by every decision taken while the previous batch was in flight. ``put`` waits
while ``max_pending`` events are pending (back-pressure, not an unbounded queue).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from schemas import ControlEvent


class Outbox:
    def __init__(
        self,
        flush: Callable[[], Awaitable[None]],
        send: Callable[[Sequence[ControlEvent]], Awaitable[None]],
        max_pending: int = 10_000,
    ) -> None:
        self._flush = flush
        self._send = send
        self._max_pending = max_pending
        self._pending: list[ControlEvent] = []
        self._flush_first = False
        self._changed = asyncio.Condition()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def put(self, events: Sequence[ControlEvent], *, flush_first: bool) -> None:
        """Queue ``events`` for publication; ``flush_first``: their records were just
        written and must be durable before any of them is published."""
        if not events:
            return
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._pending) < self._max_pending)
            self._pending.extend(events)
            self._flush_first |= flush_first
            self._changed.notify_all()

    async def run(self) -> None:
        """The publisher: runs until cancelled; a batch being published when it is
        cancelled is left to ``drain``."""
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: bool(self._pending))
            await self.drain()

    async def drain(self, *, durable: bool = False) -> None:
        """Publish everything pending now (``run`` does; on stop, once ``run`` is
        cancelled, the shell calls it again). ``durable``: every record is known to be
        durable already (the changelog's producer was stopped, which flushes it), so no
        flush."""
        async with self._changed:
            events, self._pending = self._pending, []
            flush_first, self._flush_first = self._flush_first, False
        if not events:
            return
        try:
            if flush_first and not durable:
                await self._flush()
            await self._send(events)
        except BaseException:
            # Not published: put back in front, in order, for the next attempt.
            async with self._changed:
                self._pending[:0] = events
                self._flush_first |= flush_first
            raise
        async with self._changed:
            self._changed.notify_all()  # room again for blocked putters
