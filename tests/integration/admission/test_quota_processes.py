"""K admission processes, one consumer group, one basic-tier tenant: together they never
admit more than capacity + rate × elapsed, counted exactly.

How elapsed is measured: every quota decision is taken by ``bucket.lua`` on the Redis
server's clock, and each process logs it (at DEBUG, ``msg="quota decided"``, with the
bucket and ``server_time``). The test reads those logs: elapsed runs from the tenant's
first decision (which created its full bucket) to its last admitting decision, so one
clock measures it whichever process decided. Admissions are counted twice over: the
admitting decisions in the logs, and the records on the dispatch topic.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas import Priority, ReasonCode, Tier
from seawall_client.topics import Topics
from services.common.settings import CommonSettings
from tests.admission_helpers import TopicReader, capacity_feed, inference_request, send_all
from tests.fleet import ReplyReader, spawn_service

CAPACITY, RATE = 5, 2.0
TENANT = "solo"
BURSTS, PER_BURST, PAUSE_S = 4, 10, 0.5
PARTITIONS = 3 * 3  # three priority topics


def spawn(settings: CommonSettings, name: str, log: Path) -> subprocess.Popen[bytes]:
    return spawn_service(
        settings,
        "services.admission",
        name,
        log,
        SEAWALL_LOG_LEVEL="DEBUG",
        SEAWALL_LOG_FORMAT="json",
        SEAWALL_COMMIT_INTERVAL_S="0.05",
        SEAWALL_QUOTA_BASIC__REQUESTS__CAPACITY=str(CAPACITY),
        SEAWALL_QUOTA_BASIC__REQUESTS__RATE=str(RATE),
    )


def records(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def assigned(log: Path) -> int | None:
    """Partitions in the process's latest assignment (``None`` before the first)."""
    counts = [r["partitions"] for r in records(log) if r.get("msg") == "partitions assigned"]
    return counts[-1] if counts else None


@pytest.fixture
def admissions(
    request: pytest.FixtureRequest, settings: CommonSettings, tmp_path: Path
) -> Iterator[list[Path]]:
    k: int = request.param
    logs = [tmp_path / f"admission-{i}.log" for i in range(k)]
    procs = [spawn(settings, f"adm-{i}", log) for i, log in enumerate(logs)]
    yield logs
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            assert p.wait(timeout=30) == 0
        except subprocess.TimeoutExpired:
            p.kill()
            raise


@pytest.mark.parametrize("admissions", [1, 4], indirect=True, ids=["K=1", "K=4"])
async def test_k_processes_never_admit_beyond_the_bucket(
    settings: CommonSettings, topics: Topics, admissions: list[Path]
) -> None:
    k = len(admissions)
    deadline = time.monotonic() + 90
    while sum(assigned(log) or 0 for log in admissions) != PARTITIONS or any(
        not assigned(log) for log in admissions
    ):
        assert time.monotonic() < deadline, "the group did not settle"
        await asyncio.sleep(0.2)

    n = BURSTS * PER_BURST
    async with (
        capacity_feed(settings, topics, {"main": 10_000}),
        ReplyReader(settings, topics) as client,
        TopicReader(settings, topics.dispatch("main")) as reader,
    ):
        for b in range(BURSTS):
            burst = [
                inference_request(
                    f"q{b}-{i}", client.topic, tenant=TENANT, tier=Tier.BASIC
                ).model_copy(update={"session_id": uuid.uuid4().hex})
                for i in range(PER_BURST)
            ]
            await send_all(settings, topics.requests(Priority.BULK), burst)
            await asyncio.sleep(PAUSE_S)
        deadline = time.monotonic() + 60
        while True:
            await reader.poll()
            await client.poll(50)
            ids = {d.request.request_id for d in reader.dispatched(topics.dispatch("main"))}
            if len(ids | set(client.terminals)) >= n:
                break
            assert time.monotonic() < deadline, "not every request was decided"

    dispatches = reader.dispatched(topics.dispatch("main"))
    rejected = set(client.terminals)
    admitted_ids = {d.request.request_id for d in dispatches}
    assert not admitted_ids & rejected
    assert len(admitted_ids | rejected) == n
    for rid in rejected:
        assert client.terminals[rid][0].reason is ReasonCode.QUOTA_EXCEEDED

    decisions = [
        (r["server_time"], r["outcome"], i)
        for i, log in enumerate(admissions)
        for r in records(log)
        if r.get("msg") == "quota decided" and r.get("bucket") == TENANT
    ]
    first = min(t for t, _, _ in decisions)
    last_admit = max(t for t, outcome, _ in decisions if outcome != "reject")
    admits = sum(outcome != "reject" for _, outcome, _ in decisions)
    bound = math.floor(CAPACITY + RATE * (last_admit - first) + 1e-9)
    deciders = len({i for _, _, i in decisions})
    print(
        f"\nK={k}: {len(decisions)} decisions by {deciders} process(es) over "
        f"{last_admit - first:.3f} s of Redis time; admitted {admits} "
        f"({len(dispatches)} dispatch records), bound {bound}"
    )
    assert len(dispatches) <= admits <= bound
    assert admits >= CAPACITY
    assert rejected
    if k > 1:
        assert deciders >= 2
