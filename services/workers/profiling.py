"""Profiling a worker on an operator's request (``seawall profile``).

The operator's ``Profile`` event (status ``requested``) names the worker; the worker
runs its engine's profiler for the seconds asked (``Engine.profile``: ``cProfile`` of
the worker's event loop for the simulated engine — where its time goes —, vLLM's torch
profiler for vLLM) and answers on the same control key: ``running``, then ``written``
with the trace's path, or ``failed`` with why. Each request is served once, and only while
it is in force (a minute); one profile runs at a time.
"""

from __future__ import annotations

import asyncio
import cProfile
import logging
import time
from pathlib import Path

from schemas import Evidence, Profile
from services.common.control_state import in_force

log = logging.getLogger(__name__)


async def cprofile_for(seconds: float, path: Path) -> str:
    """Profile this thread's event loop (every task of the process) for ``seconds``;
    the ``pstats`` file's path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        await asyncio.sleep(seconds)
    finally:
        profiler.disable()
    profiler.dump_stats(path)
    return str(path)


def answer(request: Profile, status: str, reason: str, path: str | None = None) -> Profile:
    """The worker's answer to ``request`` (a later ``seq`` on the same key)."""
    now = time.time()
    return request.model_copy(
        update={
            "status": status,
            "path": path,
            "seq": max(request.seq + 1, int(now * 1_000_000)),
            "issued_at": now,
            "issuer": request.scope,
            "evidence": Evidence(reason=reason[:512], metrics={"seconds": request.seconds}),
        }
    )


class Profiles:
    """Which requests this worker has taken (pure bookkeeping; the worker runs them)."""

    def __init__(self, worker_id: str) -> None:
        self.scope = f"worker:{worker_id}"
        self._taken: set[int] = set()
        self.running = False

    def take(self, event: Profile, now: float) -> bool:
        """Whether to run ``event``: a request for this worker, still in force (a worker
        that restarts and reads the topic again does not run old ones), not taken
        before, while no other runs."""
        if event.scope != self.scope or event.status != "requested" or self.running:
            return False
        if not in_force(event, now):
            return False
        if event.request in self._taken:
            return False
        self._taken.add(event.request)
        return True
