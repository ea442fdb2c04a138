"""The controller's outbox: nothing published before the flush that makes its records
durable, one flush for every event pending together, order kept, bounded, and nothing
dropped when a publication fails."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import pytest

from schemas import BreakerState, ControlEvent, Evidence
from services.controller.outbox import Outbox

pytestmark = pytest.mark.unit


def event(seq: int) -> ControlEvent:
    return BreakerState(
        scope=f"worker:w{seq}",
        seq=seq,
        issued_at=1.0,
        valid_for_s=60.0,
        evidence=Evidence(reason="test"),
        state="closed",
    )


class Broker:
    """Records the outbox's calls in order; a flush can be held open."""

    def __init__(self) -> None:
        self.calls: list[str | list[int]] = []
        self.open = asyncio.Event()
        self.open.set()
        self.flushing = asyncio.Event()
        self.fail_sends = 0

    async def flush(self) -> None:
        self.flushing.set()
        await self.open.wait()
        self.calls.append("flush")

    async def send(self, events: Sequence[ControlEvent]) -> None:
        if self.fail_sends:
            self.fail_sends -= 1
            raise OSError("broker gone")
        self.calls.append([e.seq for e in events])


@contextlib.asynccontextmanager
async def running(outbox: Outbox) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(outbox.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await task


async def sent(broker: Broker, publications: int) -> None:
    """Wait (1 s at most) until the broker saw ``publications`` sends."""
    for _ in range(1000):
        if sum(isinstance(c, list) for c in broker.calls) >= publications:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"calls so far: {broker.calls}")


async def test_a_lone_change_is_flushed_then_published_at_once() -> None:
    broker = Broker()
    outbox = Outbox(broker.flush, broker.send)
    async with running(outbox):
        await outbox.put([event(1), event(2)], flush_first=True)
        await sent(broker, 1)
    assert broker.calls == ["flush", [1, 2]]


async def test_republished_events_alone_need_no_flush() -> None:
    broker = Broker()
    outbox = Outbox(broker.flush, broker.send)
    async with running(outbox):
        await outbox.put([event(1)], flush_first=False)
        await sent(broker, 1)
    assert broker.calls == [[1]]


async def test_changes_taken_during_a_flush_share_the_next_one() -> None:
    broker = Broker()
    broker.open.clear()
    outbox = Outbox(broker.flush, broker.send)
    async with running(outbox):
        await outbox.put([event(1)], flush_first=True)
        await broker.flushing.wait()
        for seq in range(2, 12):  # ten decisions while the first flush is in flight
            await outbox.put([event(seq)], flush_first=True)
        assert broker.calls == []  # nothing published before its flush completed
        broker.open.set()
        await sent(broker, 2)
    assert broker.calls == ["flush", [1], "flush", list(range(2, 12))]


async def test_put_waits_while_the_outbox_is_full() -> None:
    broker = Broker()
    broker.open.clear()
    outbox = Outbox(broker.flush, broker.send, max_pending=2)
    async with running(outbox):
        await outbox.put([event(1)], flush_first=True)
        await broker.flushing.wait()  # event 1 is in flight, no longer pending
        await outbox.put([event(2), event(3)], flush_first=True)
        blocked = asyncio.create_task(outbox.put([event(4)], flush_first=True))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        assert outbox.pending == 2
        broker.open.set()
        await asyncio.wait_for(blocked, 1)
        await sent(broker, 3)
    published = [seq for call in broker.calls if isinstance(call, list) for seq in call]
    assert published == [1, 2, 3, 4]


async def test_a_failed_publication_keeps_its_events_in_order_for_the_next_drain() -> None:
    broker = Broker()
    broker.fail_sends = 1
    outbox = Outbox(broker.flush, broker.send)
    async with running(outbox) as task:
        await outbox.put([event(1), event(2)], flush_first=True)
        with pytest.raises(OSError, match="broker gone"):
            await asyncio.wait_for(task, 1)  # the publisher fails: its component does
    await outbox.put([event(3)], flush_first=False)
    await outbox.drain()
    assert broker.calls == ["flush", "flush", [1, 2, 3]]


async def test_drain_after_the_changelog_stopped_publishes_without_a_flush() -> None:
    broker = Broker()
    outbox = Outbox(broker.flush, broker.send)
    await outbox.put([event(1)], flush_first=True)  # no publisher running: pending
    await outbox.drain(durable=True)
    assert broker.calls == [[1]]
