"""A worker SIGKILLed mid-stream: its requests go to another worker of the group, and
every client still ends with exactly one terminal reply per request (duplicates only as
repeats of the same request id)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from seawall_client.topics import Topics
from services.common.bus import make_consumer
from services.common.settings import CommonSettings
from tests.fleet import ReplyReader, dispatched, produce, spawn_service


def spawn_worker(settings: CommonSettings, name: str, log: Path) -> subprocess.Popen[bytes]:
    return spawn_service(
        settings,
        "services.workers",
        name,
        log,
        SEAWALL_BATCH_LIMIT="4",
        SEAWALL_SIM_TIME_SCALE="1.0",
        SEAWALL_COMMIT_INTERVAL_S="0.05",
    )


@pytest.fixture
def workers(settings: CommonSettings, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [spawn_worker(settings, f"w{i}", tmp_path / f"w{i}.log") for i in range(2)]
    yield procs
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


async def test_sigkilled_worker_requests_complete_elsewhere(
    settings: CommonSettings, topics: Topics, workers: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    n = 24
    async with ReplyReader(settings, topics) as client:
        requests = [dispatched(i, client.topic, max_tokens=120) for i in range(n)]
        await produce(settings, topics.dispatch("main"), requests)

        # Kill the worker that is streaming, once chunks flow and replies are pending.
        deadline = time.monotonic() + 60
        victim = None
        while victim is None and time.monotonic() < deadline:
            await client.poll(100)
            busy = {c.worker_id for chunks in client.chunks.values() for c in chunks} - {
                t[0].worker_id for t in client.terminals.values()
            }
            streaming = [w for w in ("w0", "w1") if w in busy]
            if streaming and len(client.terminals) < n // 2:
                victim = streaming[0]
        assert victim is not None, "no worker was seen streaming"
        victim_proc = workers[int(victim[1])]
        victim_proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        unfinished_by_victim = {
            rid
            for rid, chunks in client.chunks.items()
            if any(c.worker_id == victim for c in chunks) and rid not in client.terminals
        }
        assert unfinished_by_victim, "the victim had no request mid-stream"

        await client.wait_terminals(n, timeout_s=120)
        recovered_after = time.monotonic() - killed_at
        for _ in range(10):
            await client.poll(100)

    assert victim_proc.wait(timeout=5) == -signal.SIGKILL
    assert set(client.terminals) == {d.request.request_id for d in requests}  # none lost
    for rid, replies in client.terminals.items():
        assert all(r.request_id == rid for r in replies)
        assert len({r.worker_id for r in replies}) <= 2
    survivor = "w1" if victim == "w0" else "w0"
    for rid in unfinished_by_victim:
        assert client.terminals[rid][0].worker_id == survivor
    print(
        f"\nkilled {victim} with {len(unfinished_by_victim)} requests mid-stream; "
        f"all {n} answered {recovered_after:.1f}s after the kill"
    )


async def test_sigterm_drains_in_flight_work_then_commits(
    settings: CommonSettings, topics: Topics, tmp_path: Path
) -> None:
    proc = spawn_worker(settings, "w-drain", tmp_path / "drain.log")
    try:
        n = 6
        async with ReplyReader(settings, topics) as client:
            await produce(
                settings,
                topics.dispatch("main"),
                [dispatched(i, client.topic, max_tokens=150) for i in range(n)],
            )
            deadline = time.monotonic() + 60
            while len(client.chunks) < 4 and time.monotonic() < deadline:
                await client.poll(100)
            in_flight = set(client.chunks) - set(client.terminals)
            assert in_flight, "nothing was mid-stream when SIGTERM came"
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 60) == 0
            for _ in range(10):
                await client.poll(100)
        # Everything it had started was finished before it exited, not abandoned.
        assert in_flight <= set(client.terminals)
        for rid in in_flight:
            (reply,) = client.terminals[rid]
            assert reply.completion_tokens == 150
    finally:
        if proc.poll() is None:
            proc.kill()

    # What it finished was committed: the group's committed offsets cover those records.
    consumer = make_consumer(settings, group_id=f"{settings.topic_prefix}seawall.workers.main")
    await consumer.start()
    try:
        tps = [TopicPartition(topics.dispatch("main"), p) for p in range(settings.topic_partitions)]
        committed = sum([await consumer.committed(tp) or 0 for tp in tps])
        assert committed >= len(client.terminals)
    finally:
        await consumer.stop()
    log = (tmp_path / "drain.log").read_text()
    assert "draining" in log
