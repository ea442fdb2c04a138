from __future__ import annotations

import asyncio

import pytest

from services.common import lifecycle
from services.common.lifecycle import Component, cancel_tasks, wait_set


class Looper(Component):
    name = "looper"

    def __init__(self, crash: bool = False) -> None:
        super().__init__()
        self.crash = crash
        self.stops = 0

    async def on_start(self) -> None:
        self.spawn(self._loop(), "loop")

    async def _loop(self) -> None:
        await asyncio.sleep(0)
        if self.crash:
            raise RuntimeError("boom")
        await asyncio.Event().wait()

    async def on_stop(self) -> None:
        self.stops += 1


def _component_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("looper:")]


async def test_stop_is_idempotent_and_leaves_no_task() -> None:
    c = Looper()
    async with c:
        assert c.running
        assert len(_component_tasks()) == 1
    await c.stop()
    await asyncio.gather(c.stop(), c.stop())
    assert c.stops == 1
    assert _component_tasks() == []


async def test_a_crashed_loop_marks_the_component_failed() -> None:
    c = Looper(crash=True)
    await c.start()
    await asyncio.wait_for(c.failed.wait(), 1)
    assert isinstance(c.failure, RuntimeError)
    await c.stop()


async def test_a_failed_start_cleans_up() -> None:
    class Broken(Looper):
        async def on_start(self) -> None:
            await super().on_start()
            raise OSError("port taken")

    c = Broken()
    with pytest.raises(OSError, match="port taken"):
        await c.start()
    assert _component_tasks() == []
    assert c.stops == 1


async def test_a_loop_waiting_on_an_event_stops_when_cancelled_as_the_event_is_set() -> None:
    """The race ``asyncio.wait_for`` loses on Python 3.11: the cancellation arrives in
    the same loop iteration as the event it waits for, and the loop would go on."""
    event = asyncio.Event()
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            await wait_set(event, 10.0)
            event.clear()
            rounds += 1

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # the loop waits on the event
    event.set()
    task.cancel()
    async with asyncio.timeout(5):
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(outcome, asyncio.CancelledError)
    assert rounds == 0


async def test_wait_set_says_whether_the_event_came_in_time() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    event.set()
    assert await wait_set(event, 0.01) is True


async def test_cancel_tasks_ends_a_task_that_swallows_its_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As aiokafka's client close does: the first cancellation is suppressed and the
    task goes on; it is cancelled again until it ends."""
    monkeypatch.setattr(lifecycle, "RECANCEL_S", 0.01)
    cancels = 0

    async def stubborn() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels == 3:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_tasks({task}), 5)
    assert task.cancelled()
    assert cancels == 3


async def test_a_stop_does_not_reraise_what_a_task_raised() -> None:
    async def failing() -> None:
        raise RuntimeError("boom")

    done = asyncio.create_task(failing())
    running = asyncio.create_task(asyncio.Event().wait())
    await asyncio.sleep(0)
    await cancel_tasks({done, running})
    assert running.cancelled()
    assert isinstance(done.exception(), RuntimeError)
