"""Nothing lost end to end while processes die: the stack as `seawall up` runs it, async
clients (the SDK) sending a steady stream of requests from three tiers, and during the
run a worker is SIGKILLed, admission is restarted (SIGTERM, then the supervisor starts
it again), the controller is SIGKILLed and restarted, and Redis is unreachable for a
few seconds. Counted, not sampled: every request submitted gets exactly one terminal
reply; duplicates only as repeats of the same request id."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from schemas import InferenceReply, ReplyChunk, ReplyStatus
from seawall.client import SeawallClient
from tests.e2e.conftest import Stack, launch
from tests.faults import TcpProxy

RATE_PER_S = 3.0
DURATION_S = 50.0
TIMEOUT_S = 150.0
REDIS_CUT_S = 5.0
MAX_TOKENS = 160
"""About 2 s of simulated decoding: a worker always has requests mid-stream."""


@dataclass
class Call:
    request_id: str
    tier: str
    sent_at: float
    chunk_workers: list[str | None] = field(default_factory=list)
    terminal: InferenceReply | None = None
    terminals: int = 0
    done_at: float | None = None
    error: BaseException | None = None


@dataclass
class Fault:
    at_s: float
    name: str
    act: Callable[[], object]
    done_at: float | None = None
    detail: str = ""


def kill(stack: Stack, instance: str, sig: signal.Signals) -> str:
    proc = stack.service(instance)
    proc.send_signal(sig)
    return f"{instance} pid {proc.pid} {sig.name}"


def wait_restarted(stack: Stack, instance: str, old_pid: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = stack.service(instance).pid
        except LookupError:
            pid = old_pid
        if pid != old_pid:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"{instance} was not restarted")


async def send(client: SeawallClient, call: Call, max_tokens: int) -> None:
    try:
        async for item in client.stream(
            f"question {call.request_id}",
            max_tokens=max_tokens,
            request_id=call.request_id,
            timeout_s=TIMEOUT_S,
        ):
            if isinstance(item, ReplyChunk):
                call.chunk_workers.append(item.worker_id)
            else:
                call.terminal = item
                call.terminals += 1
                call.done_at = time.monotonic()
    except Exception as e:  # counted as lost below, with the reason shown
        call.error = e


@pytest.fixture(scope="module")
def redis_proxy(redis_url: str) -> TcpProxy:
    target = urlsplit(redis_url)
    with TcpProxy(target.hostname or "127.0.0.1", target.port or 6379) as proxy:
        yield proxy  # type: ignore[misc]


async def test_every_request_gets_one_terminal_reply_through_every_fault(
    tmp_path: Path, redis_proxy: TcpProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    with launch(tmp_path, redis_proxy.url()) as stack:  # default fleet: 2 main, 1 small
        keys = {tier: stack.key(f"faults-{tier}", tier) for tier in ("enterprise", "pro", "basic")}
        clients = {
            tier: SeawallClient(api_key_id=key["key_id"], settings=stack.settings)
            for tier, key in keys.items()
        }
        for c in clients.values():
            await c.start()
        calls: list[Call] = []
        tasks: list[asyncio.Task[None]] = []
        pids = {n: stack.service(n).pid for n in ("admission", "controller")}
        victim: dict[str, str] = {}
        mid_stream: set[str] = set()

        def kill_streaming_worker() -> str:
            # The main worker streaming the most requests now: its requests are mid-flight.
            busy = collections.Counter(
                c.chunk_workers[-1]
                for c in calls
                if c.terminal is None and c.chunk_workers and c.chunk_workers[-1]
            )
            name = next(
                (w for w, _ in busy.most_common() if w and w.startswith("worker-main")),
                "worker-main-0",
            )
            victim["name"] = name
            victim["pid"] = str(stack.service(name).pid)
            mid_stream.update(
                c.request_id for c in calls if c.terminal is None and name in c.chunk_workers
            )
            return kill(stack, name, signal.SIGKILL)

        faults = [
            Fault(8, "worker SIGKILL", kill_streaming_worker),
            Fault(18, "admission restart", lambda: kill(stack, "admission", signal.SIGTERM)),
            Fault(28, "controller SIGKILL", lambda: kill(stack, "controller", signal.SIGKILL)),
            Fault(
                38, f"Redis unreachable {REDIS_CUT_S:.0f}s", lambda: redis_proxy.cut(REDIS_CUT_S)
            ),
        ]
        tiers = list(clients)
        start = time.monotonic()
        n = int(RATE_PER_S * DURATION_S)
        pending = list(faults)
        for i in range(n):
            due = start + i / RATE_PER_S
            while pending and due >= start + pending[0].at_s:
                fault = pending.pop(0)
                await asyncio.sleep(max(0.0, start + fault.at_s - time.monotonic()))
                fault.act()
                fault.done_at = time.monotonic()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tier = tiers[i % len(tiers)]
            call = Call(f"f{i:04d}", tier, time.monotonic())
            calls.append(call)
            tasks.append(asyncio.create_task(send(clients[tier], call, max_tokens=MAX_TOKENS)))
        assert not pending, "the run ended before every fault was injected"
        await asyncio.wait(tasks, timeout=TIMEOUT_S + 30)
        for _ in range(10):  # let late duplicates arrive to be counted
            await asyncio.sleep(0.2)
        stats = {tier: c.stats for tier, c in clients.items()}
        for c in clients.values():
            await c.stop()

        # The faults happened: each process is a new one now.
        assert wait_restarted(stack, victim["name"], int(victim["pid"])) != int(victim["pid"])
        for name, pid in pids.items():
            wait_restarted(stack, name, pid)
        assert redis_proxy.refused > 0, "nothing tried to reach Redis while it was cut"

    lost = [c for c in calls if c.terminal is None]
    assert not lost, f"{len(lost)} lost, e.g. {lost[0].request_id}: {lost[0].error!r}"
    assert all(c.terminals == 1 for c in calls)
    assert sum(s.terminal_replies for s in stats.values()) == len(calls)
    assert sum(s.submitted for s in stats.values()) == len(calls)
    for c in calls:
        assert c.terminal is not None
        assert c.terminal.request_id.split(".")[0] == c.request_id
    by_status = collections.Counter(c.terminal.status.value for c in calls if c.terminal)
    # Failover: what the victim was streaming when it died was finished after all, by
    # the other main worker or by the victim's restarted process (the same instance name).
    killed_at = faults[0].done_at
    assert killed_at is not None
    assert mid_stream, "the killed worker had no request mid-stream"
    moved = [c for c in calls if c.request_id in mid_stream]
    recovery = sorted(c.done_at - killed_at for c in moved if c.done_at is not None)
    report = {
        "submitted": len(calls),
        "terminal_replies": sum(c.terminals for c in calls),
        "lost": len(lost),
        "duplicates_dropped": sum(s.duplicates for s in stats.values()),
        "retries": sum(s.retries for s in stats.values()),
        "by_status": dict(by_status),
        "by_reason": dict(
            collections.Counter(c.terminal.reason.value for c in calls if c.terminal)
        ),
        "faults": {f.name: round((f.done_at or 0) - start, 1) for f in faults},
        "killed_worker": victim["name"],
        "killed_worker_requests_mid_stream": len(moved),
        "finished_by": dict(collections.Counter(c.terminal.worker_id for c in moved if c.terminal)),
        "their_completion_after_kill_s": [round(r, 1) for r in recovery],
        "redis_connections_refused_while_cut": redis_proxy.refused,
    }
    with capsys.disabled():
        print("\nfault suite:", json.dumps(report))
    assert by_status[ReplyStatus.OK.value] + by_status.get(ReplyStatus.DEGRADED.value, 0) > 0
