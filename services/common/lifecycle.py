"""The lifecycle every component shares (arq-style: small, explicit, clean shutdown).

``Component``: ``start()``/``stop()`` or ``async with``; ``stop`` is idempotent and
cancels and awaits every task the component spawned, so nothing is orphaned.
``run_until_signalled``: start, wait for SIGTERM/SIGINT (or for a background task to
crash), then stop — the component's ``on_stop`` drains: stop fetching, finish
in-flight work within the grace period, commit, close.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Self

log = logging.getLogger(__name__)


class Component:
    """Subclasses implement ``on_start`` and ``on_stop`` and spawn their loops with
    ``spawn``. A loop that raises marks the component failed (``failed`` is set), so
    its process exits non-zero and its supervisor restarts it (crash-only)."""

    name = "component"

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False
        self._stop_lock = asyncio.Lock()
        self._stopped = False
        self.failed = asyncio.Event()
        self.failure: BaseException | None = None

    async def on_start(self) -> None:
        """Acquire resources; spawn loops."""

    async def on_stop(self) -> None:
        """Drain and release resources; spawned tasks are cancelled after it returns."""

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not self._stopped:
            log.error("task failed", exc_info=exc, extra={"task": task.get_name()})
            self.failure = exc
            self.failed.set()

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        try:
            await self.on_start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        async with self._stop_lock:
            if self._stopped or not self._started:
                self._stopped = True
                return
            try:
                await self.on_stop()
            finally:
                self._stopped = True
                await cancel_tasks(self._tasks)

    @property
    def running(self) -> bool:
        return self._started and not self._stopped

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` was set within ``timeout_s``: the wait of a loop that also
    wakes on a timer. Not ``asyncio.wait_for``: before Python 3.12 it can swallow a
    cancellation that arrives just as the event is set, and a loop built on it then
    never stops (seen: admission's dispatch task still looping, "cancelling", at
    shutdown, until the test's timeout)."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


RECANCEL_S = 1.0
"""How long a cancelled task has to end before it is cancelled again."""


async def cancel_tasks(tasks: set[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again every
    ``RECANCEL_S`` the ones still running. A task can swallow a cancellation and run on:
    aiokafka's ``AIOKafkaClient.close`` suppresses ``CancelledError`` while it awaits its
    own metadata task, so a loop cancelled just as it closes a producer carries on (seen:
    a test's feeder still producing, and its ``gather`` waiting, until CI's timeout).
    What the tasks raised is retrieved and dropped: a stop does not re-raise it."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for t in tasks:
        if not t.cancelled():
            t.exception()


async def run_until_signalled(component: Component, grace_s: float) -> int:
    """Run ``component`` until SIGTERM/SIGINT; exit code 0 on a clean stop, 1 if a loop
    crashed or the drain overran ``grace_s`` (plus a margin for closing connections)."""
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        await component.start()
        log.info("started", extra={"component": component.name})
        waits = [
            asyncio.create_task(stop_requested.wait()),
            asyncio.create_task(component.failed.wait()),
        ]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        await cancel_tasks(set(waits))
        log.info(
            "stopping", extra={"component": component.name, "failed": component.failed.is_set()}
        )
        try:
            await asyncio.wait_for(component.stop(), timeout=grace_s + 10)
        except TimeoutError:
            log.error("drain overran its grace period", extra={"grace_s": grace_s})
            return 1
        return 1 if component.failed.is_set() else 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
