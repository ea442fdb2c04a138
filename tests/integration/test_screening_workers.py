"""``services.common.screening.Screener`` with real worker processes: long prompts are
screened there with the same answer as inline, short ones inline; a worker killed
mid-work costs its prompt nothing (screened inline, never passed unscreened) and is
replaced; a caller that gives up leaves no answer behind for the next; workers go with
their screener, or with their service's process however it ends."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from services.common.screening import Screener, analyse

pytestmark = pytest.mark.integration

LONG = (
    "The quick brown fox jumps over the lazy dog. " * 60
    + "my card 4111 1111 1111 1111 and pwd: hunter2, order 4111111111111111. "
    + "The quick brown fox jumps over the lazy dog. " * 60
)
SHORT = "hello pwd: hunter2"


def workers_of(screener: Screener) -> list[psutil.Process]:
    return [psutil.Process(w.proc.pid) for w in screener._workers]


async def test_long_prompts_are_screened_by_a_worker_as_inline() -> None:
    screener = Screener(workers=2, offload_chars=1000, owner="ingress")
    await screener.start()
    try:
        workers = workers_of(screener)
        # Not taken for their owner by whatever finds a service by its instance id.
        assert {w.environ()["SEAWALL_INSTANCE_ID"] for w in workers} == {"ingress.screen"}
        before = sum(w.cpu_times().user for w in workers)
        for policy in ("redact", "block"):
            assert await screener.analyse([LONG, SHORT], policy) == analyse([LONG, SHORT], policy)
        assert screener.offloaded == 2
        result = await screener.analyse([LONG], "redact")
        assert result.screenings[0].findings  # found, redacted
        assert result.redacted_tokens != result.tokens
        for _ in range(30):  # enough work to show on the workers' clocks
            await screener.analyse([LONG * 4], "redact")
        assert sum(w.cpu_times().user for w in workers) - before >= 0.05
    finally:
        await screener.close()


async def test_short_prompts_are_screened_inline() -> None:
    screener = Screener(workers=1, offload_chars=1000)
    await screener.start()
    try:
        for _ in range(50):
            assert await screener.analyse([SHORT], "redact") == analyse([SHORT], "redact")
        assert screener.offloaded == 0
    finally:
        await screener.close()


async def test_a_killed_worker_costs_its_prompt_nothing_and_is_replaced() -> None:
    screener = Screener(workers=1, offload_chars=1000)
    await screener.start()
    try:
        (worker,) = workers_of(screener)
        big = [LONG * 40]  # long enough to be mid-work when killed
        call = asyncio.ensure_future(screener.analyse(big, "redact"))
        await asyncio.sleep(0.005)
        worker.kill()
        assert await call == analyse(big, "redact")  # screened inline instead
        assert screener.replaced == 1
        await asyncio.wait_for(asyncio.gather(*screener._respawning), 10)
        (new,) = workers_of(screener)
        assert new.pid != worker.pid
        assert await screener.analyse([LONG], "block") == analyse([LONG], "block")
    finally:
        await screener.close()


async def test_a_caller_that_gives_up_leaves_no_answer_for_the_next() -> None:
    screener = Screener(workers=1, offload_chars=1000)
    await screener.start()
    try:
        first = asyncio.ensure_future(screener.analyse([LONG * 20], "redact"))
        await asyncio.sleep(0.001)
        first.cancel()
        second = await screener.analyse([LONG], "block")
        assert second == analyse([LONG], "block")  # its own answer, not the first's
    finally:
        await screener.close()


async def test_close_stops_the_workers_and_later_prompts_are_screened_inline() -> None:
    screener = Screener(workers=2, offload_chars=1000)
    await screener.start()
    procs = workers_of(screener)
    await screener.close()
    await screener.close()  # idempotent
    _, alive = psutil.wait_procs(procs, timeout=5)
    assert alive == []
    assert await screener.analyse([LONG], "redact") == analyse([LONG], "redact")


def test_workers_go_with_their_process_however_it_ends(tmp_path: object) -> None:
    """SIGKILL gives the service no chance to close anything: its workers see their
    stdin close and exit; SIGTERM and SIGINT to the whole process group are the
    service's to handle, and the workers outlive them until it closes."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        from services.common.screening import Screener

        async def main():
            s = Screener(workers=2, offload_chars=10)
            await s.start()
            print(" ".join(str(w.proc.pid) for w in s._workers), flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    service = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=os.getcwd(),
    )
    try:
        assert service.stdout is not None
        pids = [int(p) for p in service.stdout.readline().split()]
        workers = [psutil.Process(p) for p in pids]
        os.kill(pids[0], signal.SIGTERM)
        os.kill(pids[1], signal.SIGINT)
        time.sleep(0.3)
        assert all(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
        service.kill()
        _, alive = psutil.wait_procs(workers, timeout=5)
        assert alive == []
    finally:
        if service.poll() is None:
            os.killpg(service.pid, signal.SIGKILL)
        service.wait()
