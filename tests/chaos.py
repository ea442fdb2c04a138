"""The kill matrix, for the end-to-end test and ``bench/faults.py``: an open-loop stream
of requests from async clients (the SDK) of every tier into ``seawall up``, while
ingress, admission, the main worker streaming the most, and the controller are each
SIGKILLed in turn and Redis is cut off for a few seconds. Everything is counted, not
sampled: each call's chunks and terminal replies as the caller saw them, the consumer
lag of ingress and admission while they were down (the backlog), and what became of the
killed worker's requests: those it held when it died (read from its heartbeats'
partitions and the dispatch topic) complete elsewhere — a normal reply for a
non-streamed request or one that had shown no text yet (kill → completion timed), the
documented ``stream_interrupted`` for a stream that had (kill → that error timed)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from schemas import (
    InferenceReply,
    Priority,
    ReasonCode,
    ReplyChunk,
    ReplyStatus,
    WorkerHeartbeat,
    WorkerReport,
)
from seawall_client import SeawallClient
from seawall_client.serde import DISPATCH, TELEMETRY, DecodeError, decode
from services.common.bus import make_consumer, topics_of
from services.common.lifecycle import cancel_tasks
from tests.faults import TcpProxy
from tests.fleet import in_background
from tests.stack import Stack


@dataclass
class Call:
    request_id: str
    tier: str
    sent_at: float
    stream: bool = True
    chunks: list[ReplyChunk] = field(default_factory=list)
    terminals: list[InferenceReply] = field(default_factory=list)
    done_at: float | None = None
    error: BaseException | None = None

    @property
    def terminal(self) -> InferenceReply | None:
        return self.terminals[0] if self.terminals else None

    @property
    def streamed(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def duplicated(self) -> bool:
        """The caller saw something twice: a second terminal, or a chunk again."""
        seen = [(c.generation, c.seq) for c in self.chunks]
        return len(self.terminals) > 1 or len(seen) != len(set(seen))

    @property
    def coherent(self) -> bool:
        """Its streamed text is its terminal reply's text, or the stream ended with the
        documented ``stream_interrupted`` error (never two generations spliced); a call
        not streamed saw no chunk."""
        t = self.terminal
        if t is None:
            return False
        if not self.stream:
            return not self.chunks
        if t.reason is ReasonCode.STREAM_INTERRUPTED:
            return True
        if t.status not in (ReplyStatus.OK, ReplyStatus.DEGRADED) or t.text == "":
            return not self.chunks or t.status is ReplyStatus.ERROR
        return self.streamed == t.text


async def send(client: SeawallClient, call: Call, max_tokens: int, timeout_s: float) -> None:
    try:
        prompt = f"question {call.request_id}"
        if not call.stream:
            reply = await client.complete(
                prompt, max_tokens=max_tokens, request_id=call.request_id, timeout_s=timeout_s
            )
            call.terminals.append(reply)
            call.done_at = time.monotonic()
            return
        async for item in client.stream(
            prompt, max_tokens=max_tokens, request_id=call.request_id, timeout_s=timeout_s
        ):
            if isinstance(item, ReplyChunk):
                call.chunks.append(item)
            else:
                call.terminals.append(item)
                call.done_at = time.monotonic()
    except Exception as e:  # counted as lost, with the reason shown
        call.error = e


@dataclass
class Fault:
    at_s: float
    name: str
    act: Callable[[], str | Awaitable[str]]
    ready: Callable[[], bool] = lambda: True
    """Fired at the first moment from ``at_s`` on when this holds (at most 15 s later)."""
    done_at: float | None = None
    detail: str = ""


def kill(stack: Stack, instance: str, sig: signal.Signals = signal.SIGKILL) -> str:
    proc = stack.service(instance)
    proc.send_signal(sig)
    return f"{instance} pid {proc.pid} {sig.name}"


def cut(proxy: TcpProxy, seconds: float) -> str:
    proxy.cut(seconds)
    return f"cut off for {seconds:.0f} s"


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


class LagSampler:
    """Samples, every ``every_s``, how many records wait for a consumer group (end
    offsets minus committed offsets): the backlog that builds while it is down."""

    def __init__(self, stack: Stack, groups: dict[str, list[str]], every_s: float = 0.5):
        self._stack = stack
        self._groups = groups
        self._every_s = every_s
        self.peak: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        """Samples that failed, by error."""
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LagSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        await cancel_tasks({self._task})

    async def _run(self) -> None:
        settings = self._stack.settings
        # A consumer of each group that never subscribes: it reads the group's committed
        # offsets without joining it.
        readers = {g: make_consumer(settings, group_id=g) for g in self._groups}
        for reader in readers.values():
            await reader.start()
        try:
            while True:
                for group, topics in self._groups.items():
                    try:
                        lag = await self._lag(readers[group], topics)
                    except Exception as e:  # a broker busy with a rebalance: the next one
                        self.errors[f"{type(e).__name__}: {e}"[:120]] += 1
                        continue
                    self.peak[group] = max(self.peak[group], lag)
                await asyncio.sleep(self._every_s)
        finally:
            for reader in readers.values():
                await reader.stop()

    async def _lag(self, reader: Any, topics: list[str]) -> int:
        tps = [
            TopicPartition(t, p)
            for t in topics
            for p in range(self._stack.settings.topic_partitions)
        ]
        ends = await reader.end_offsets(tps)
        committed = [await reader.committed(tp) or 0 for tp in tps]
        return sum(max(0, ends[tp] - c) for tp, c in zip(tps, committed, strict=True))


class DispatchWatch:
    """Reads a pool's dispatch topic and the telemetry while the matrix runs (``run``,
    under ``tests.fleet.in_background``): where each request was dispatched (partition,
    when), and the dispatch partitions each worker owned by its latest heartbeat."""

    def __init__(self, stack: Stack, pool: str) -> None:
        self._stack = stack
        self._topics = topics_of(stack.settings)
        self._pool = pool
        self.dispatched: dict[str, tuple[int, float]] = {}
        """Request id (the caller's, without an attempt's suffix) → (partition, when:
        the record's timestamp, epoch seconds) of its first dispatch."""
        self.partitions: dict[str, tuple[int, ...]] = {}

    async def run(self) -> None:
        dispatch, telemetry = self._topics.dispatch(self._pool), self._topics.telemetry
        reader = make_consumer(self._stack.settings, dispatch, telemetry, group_id=None)
        await reader.start()
        try:
            while True:
                for records in (await reader.getmany(timeout_ms=200)).values():
                    for r in records:
                        with contextlib.suppress(DecodeError):
                            self._read(r.topic == dispatch, r.value, r.partition, r.timestamp)
        finally:
            await reader.stop()

    def _read(self, dispatch: bool, value: bytes, partition: int, timestamp_ms: int) -> None:
        if dispatch:
            d = decode(DISPATCH, value)
            if d.shadow_of is None:
                base = d.request.request_id.split(".", 1)[0]
                self.dispatched.setdefault(base, (partition, timestamp_ms / 1000))
            return
        msg = decode(TELEMETRY, value)
        beat = msg.heartbeat if isinstance(msg, WorkerReport) else msg
        if isinstance(beat, WorkerHeartbeat) and beat.pool == self._pool:
            self.partitions[beat.worker_id] = beat.partitions


@dataclass
class Traffic:
    rate_per_s: float
    duration_s: float
    max_tokens: int
    timeout_s: float = 150.0
    non_streamed_every: int = 2
    """Every n-th request is sent with ``complete`` (no stream), the rest streamed."""


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


FAULTS_AT_S = (5.0, 10.0, 20.0, 25.0, 29.0)
"""When ingress, admission, the worker, the controller die and Redis is cut: each while
the one before is still recovering (a restarted group member rejoins after about twice
its session, 6 s) or working off its backlog."""


async def kill_matrix(
    stack: Stack,
    redis_proxy: TcpProxy,
    traffic: Traffic,
    faults_at_s: tuple[float, ...] = FAULTS_AT_S,
) -> dict[str, Any]:
    """Run the matrix on ``stack`` (whose Redis is reached through ``redis_proxy``);
    return the figures (``tests/e2e/test_kill_matrix.py`` says what must hold)."""
    tiers = ("enterprise", "pro", "basic")
    keys = {t: stack.key(f"km-{t}", t) for t in tiers}
    clients = {t: SeawallClient(api_key=keys[t]["key"], kafka=stack.settings.kafka) for t in tiers}
    helper = SeawallClient(api_key=stack.key("km-helper", "pro")["key"], kafka=stack.settings.kafka)
    for c in (*clients.values(), helper):
        await c.start()
    calls: list[Call] = []
    victim: dict[str, Any] = {}
    pids: dict[str, int] = {}

    def kill_and_note(instance: str) -> Callable[[], str]:
        def act() -> str:
            pids[instance] = stack.service(instance).pid
            return kill(stack, instance)

        return act

    def streaming() -> collections.Counter[str]:
        """Requests early in their stream now (at most half their tokens seen), by the
        main worker streaming them. What the client has seen lags the worker by a broker
        hop or more: a stream seen nearly done may have ended at the worker already, and
        killing it then takes nothing over (a CI run killed a worker whose four streams
        had all ended)."""
        return collections.Counter(
            c.chunks[-1].worker_id
            for c in calls
            if not c.terminals
            and c.chunks
            and sum(ch.tokens for ch in c.chunks) <= traffic.max_tokens // 2
            and c.chunks[-1].worker_id
            and c.chunks[-1].worker_id.startswith("worker-main")
        )

    def unshown() -> collections.Counter[str]:
        """Non-streamed requests in flight now, by the main worker that owns the
        partition they were dispatched to (by its latest heartbeat): they show no text
        before they end, so a kill now leaves each to complete elsewhere."""
        owner = {
            p: w
            for w, owned in watch.partitions.items()
            if w.startswith("worker-main")
            for p in owned
        }
        return collections.Counter(
            owner[where[0]]
            for c in calls
            if not c.stream
            and not c.terminals
            and (where := watch.dispatched.get(c.request_id)) is not None
            and where[0] in owner
        )

    def victims() -> list[str]:
        """Main workers both mid-stream (a request early in its stream) and holding a
        request that shows nothing yet: killing one tests both kinds of takeover. Waiting
        for four streams on one worker instead left the kill to its 15 s deadline in a CI
        run (streams end fast), when the worker held one request, already streaming."""
        early, held = streaming(), unshown()
        return sorted((w for w in early if held[w]), key=lambda w: (-early[w], -held[w]))

    async def kill_holding_worker() -> str:
        """Kill a main worker mid-stream once it holds a request that shows nothing
        before it ends. Traffic alone gives such a moment within seconds when the
        machine is idle, not always under load (a CI run's kill came 15 s late with the
        victim holding one request, already streaming): so from 5 s late on, a tenant of
        its own adds non-streamed requests, every one counted like the others, until
        some worker holds one (10 s at most)."""
        deadline, j = time.monotonic() + 10, 0
        while not victims() and time.monotonic() < deadline:
            call = Call(f"kmh{j:04d}", "pro", time.monotonic(), stream=False)
            calls.append(call)
            task = send(helper, call, traffic.max_tokens, traffic.timeout_s)
            tasks.append(asyncio.create_task(task))
            j += 1
            await asyncio.sleep(0.05)
        return kill_streaming_worker()

    def kill_streaming_worker() -> str:
        # A main worker mid-stream and holding an unshown request (the busiest such).
        ready, early = victims(), streaming().most_common(1)
        if ready:
            name = ready[0]
        elif early:
            name = early[0][0]
        else:  # nothing streams on a main worker now: the one owning most partitions
            name = max(
                (w for w in watch.partitions if w.startswith("worker-main")),
                key=lambda w: len(watch.partitions[w]),
            )
        victim["name"] = name
        victim["partitions"] = set(watch.partitions.get(name, ()))  # by its last heartbeat
        victim["at"] = time.time()
        return kill_and_note(name)()

    faults = [
        Fault(faults_at_s[0], "ingress SIGKILL", kill_and_note("ingress")),
        Fault(faults_at_s[1], "admission SIGKILL", kill_and_note("admission")),
        Fault(
            faults_at_s[2],
            "worker SIGKILL mid-stream",
            kill_holding_worker,
            lambda: bool(victims()) or time.monotonic() - start > faults_at_s[2] + 5,
        ),
        Fault(faults_at_s[3], "controller SIGKILL", kill_and_note("controller")),
        Fault(faults_at_s[4], "Redis cut off 5 s", lambda: cut(redis_proxy, 5.0)),
    ]
    prefix = stack.settings.topic_prefix
    topics = topics_of(stack.settings)
    groups = {
        f"{prefix}seawall.ingress": [topics.ingress],
        f"{prefix}seawall.admission": [topics.requests(p) for p in Priority],
    }
    tasks: list[asyncio.Task[None]] = []
    watch = DispatchWatch(stack, "main")
    async with LagSampler(stack, groups) as lag, in_background(watch.run()):
        start = time.monotonic()
        pending = list(faults)
        n = int(traffic.rate_per_s * traffic.duration_s)
        for i in range(n):
            due = start + i / traffic.rate_per_s
            if pending and due >= start + pending[0].at_s:
                fault = pending[0]
                late = time.monotonic() - (start + fault.at_s)
                if fault.ready() or late > 15:
                    pending.pop(0)
                    detail = fault.act()
                    fault.detail = detail if isinstance(detail, str) else await detail
                    fault.done_at = time.monotonic()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tier = tiers[i % len(tiers)]
            call = Call(
                f"km{i:05d}", tier, time.monotonic(), stream=i % traffic.non_streamed_every != 0
            )
            calls.append(call)
            tasks.append(
                asyncio.create_task(
                    send(clients[tier], call, traffic.max_tokens, traffic.timeout_s)
                )
            )
        assert not pending, "the run ended before every fault was injected"
        await asyncio.wait(tasks, timeout=traffic.timeout_s + 30)
    for _ in range(10):  # late duplicates, had any reached the caller, are counted
        await asyncio.sleep(0.2)
    stats = {t: c.stats for t, c in (*clients.items(), ("helper", helper))}
    # The stack still serves: a fresh request after everything, answered ok.
    after = await clients["enterprise"].complete("still there?", max_tokens=8, timeout_s=60)
    for c in (*clients.values(), helper):
        await c.stop()
    restarted = {name: wait_restarted(stack, name, pid) != pid for name, pid in pids.items()}

    killed_at = faults[2].done_at
    assert killed_at is not None
    # The killed worker's requests: it had streamed a generation of them (one begun
    # before the kill: generations count microseconds) and another generation had to
    # answer them (one begun after it), whoever ran it: the other worker, or the killed
    # one's new process under the same name.
    kill_generation = int(victim["at"] * 1_000_000)
    moved = [
        c
        for c in calls
        if c.terminal is not None
        and c.terminal.generation > kill_generation
        and any(
            ch.worker_id == victim["name"] and ch.generation < kill_generation for ch in c.chunks
        )
    ]
    interrupted_after = sorted(c.done_at - killed_at for c in moved if c.done_at is not None)
    # Every request the killed worker held when it died: dispatched before the kill to a
    # partition it owned, not answered by then. Those that show no text of its (queued,
    # or not streamed) must complete elsewhere as if nothing happened.
    victim_partitions: set[int] = victim["partitions"]
    on_victim = [
        c
        for c in calls
        if (where := watch.dispatched.get(c.request_id)) is not None
        and where[0] in victim_partitions
        and where[1] < victim["at"]
        and (c.done_at is None or c.done_at > killed_at)
    ]
    # Text shown is text of the dead generation, whenever it reached the caller: chunks
    # the killed worker produced just before dying arrive a broker hop after the kill.
    showed_text = [
        c
        for c in on_victim
        if any(
            ch.worker_id == victim["name"] and ch.generation < kill_generation for ch in c.chunks
        )
    ]
    to_complete = [c for c in on_victim if c not in showed_text]
    completed = [
        c
        for c in to_complete
        if c.terminal is not None and c.terminal.status in (ReplyStatus.OK, ReplyStatus.DEGRADED)
    ]
    # On a starved machine the worker that took a request over can lose it in turn (its
    # lease, renewed every second, runs out while its event loop stalls) after it has
    # streamed text of its own: the caller is then told stream_interrupted, as when any
    # worker is lost mid-stream. Such a request was taken over and streamed; a second
    # loss, not the first failover, ended it. Counted apart, with its chunks as evidence.
    retaken = [
        c
        for c in to_complete
        if c not in completed
        and c.terminal is not None
        and c.terminal.reason is ReasonCode.STREAM_INTERRUPTED
        and any(
            kill_generation < ch.generation < c.terminal.generation and ch.text for ch in c.chunks
        )
    ]
    to_completion = sorted(c.done_at - killed_at for c in completed if c.done_at is not None)
    terminal = [c for c in calls if c.terminal is not None]
    by_status = collections.Counter(c.terminal.status.value for c in terminal if c.terminal)
    return {
        "submitted": len(calls),
        "terminal_replies": sum(len(c.terminals) for c in calls),
        "lost": sum(1 for c in calls if c.terminal is None),
        "lost_examples": [f"{c.request_id}: {c.error!r}" for c in calls if not c.terminals][:5],
        "duplicates_to_caller": sum(1 for c in calls if c.duplicated),
        "duplicates_dropped_by_sdk": sum(s.duplicates for s in stats.values()),
        "incoherent_streams": [c.request_id for c in calls if c.terminal and not c.coherent],
        "streams_interrupted": sum(
            1 for c in terminal if c.terminal and c.terminal.reason is ReasonCode.STREAM_INTERRUPTED
        ),
        "interrupted_examples": [
            {
                "id": c.request_id,
                "chunks": [(ch.generation % 10**8, ch.worker_id, ch.seq) for ch in c.chunks],
                "terminal": (c.terminal.generation % 10**8, c.terminal.worker_id),
            }
            for c in terminal
            if c.terminal and c.terminal.reason is ReasonCode.STREAM_INTERRUPTED
        ][:3],
        "retries": sum(s.retries for s in stats.values()),
        "by_status": dict(by_status),
        "by_reason": dict(
            collections.Counter(c.terminal.reason.value for c in terminal if c.terminal)
        ),
        "reasons_sent_between_s": {
            reason: [
                round(min(c.sent_at for c in group) - start, 1),
                round(max(c.sent_at for c in group) - start, 1),
            ]
            for reason, group in _by_reason(terminal).items()
        },
        "backlog_peak": dict(lag.peak),
        "backlog_sampling_errors": dict(lag.errors),
        "faults_at_s": {f.name: round((f.done_at or 0) - start, 1) for f in faults},
        "killed_worker": victim["name"],
        "killed_worker_partitions": sorted(victim_partitions),
        "killed_worker_in_flight": len(moved),
        "stream_interrupted_after_s": [round(x, 2) for x in interrupted_after],
        "stream_interrupted_after_s_p99": percentile(interrupted_after, 99),
        "on_killed_worker": {
            "held": len(on_victim),
            "showed_text": len(showed_text),
            "to_complete": len(to_complete),
            "non_streamed": sum(1 for c in to_complete if not c.stream),
            "completed_elsewhere": len(completed),
            "retaken_after_text": [
                {
                    "id": c.request_id,
                    "chunks": [(ch.generation % 10**8, ch.worker_id, ch.seq) for ch in c.chunks],
                    "terminal": (c.terminal.generation % 10**8, c.terminal.worker_id)
                    if c.terminal
                    else None,
                }
                for c in retaken
            ],
            "not_completed": [
                f"{c.request_id}: {c.terminal.status.value}/{c.terminal.reason.value}"
                if c.terminal
                else f"{c.request_id}: {c.error!r}"
                for c in to_complete
                if c not in completed and c not in retaken
            ],
        },
        "failover_to_completion_s": [round(x, 2) for x in to_completion],
        "failover_to_completion_s_p50": percentile(to_completion, 50),
        "failover_to_completion_s_p99": percentile(to_completion, 99),
        "restarted": restarted,
        "redis_connections_refused_while_cut": redis_proxy.refused,
        "served_after": after.status.value,
    }


def _by_reason(calls: list[Call]) -> dict[str, list[Call]]:
    groups: dict[str, list[Call]] = collections.defaultdict(list)
    for c in calls:
        if c.terminal is not None:
            groups[c.terminal.reason.value].append(c)
    return dict(groups)


# -- latency under a fault -------------------------------------------------------------
Outcome = tuple[float, InferenceReply | BaseException]
"""A call's latency (seconds) and its terminal reply, or what it raised."""


async def timed_call(
    client: SeawallClient, request_id: str, max_tokens: int = 16, timeout_s: float = 90
) -> Outcome:
    """One ``complete`` call: its latency and outcome."""
    started = time.monotonic()
    try:
        reply: InferenceReply | BaseException = await client.complete(
            f"question {request_id}",
            max_tokens=max_tokens,
            request_id=request_id,
            timeout_s=timeout_s,
        )
    except Exception as e:
        reply = e
    return time.monotonic() - started, reply


async def timed_calls(
    client: SeawallClient, n: int, rate_per_s: float, prefix: str, max_tokens: int = 16
) -> list[Outcome]:
    """``n`` open-loop calls at ``rate_per_s``: each one's latency and outcome."""
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(timed_call(client, f"{prefix}-{i}", max_tokens)))
        await asyncio.sleep(1 / rate_per_s)
    return list(await asyncio.gather(*tasks))


def failed(results: list[Outcome]) -> list[str]:
    return [
        repr(r) if isinstance(r, BaseException) else f"{r.request_id}: {r.status}/{r.reason}"
        for _, r in results
        if isinstance(r, BaseException) or r.status not in (ReplyStatus.OK, ReplyStatus.DEGRADED)
    ]


def p99(results: list[Outcome]) -> float:
    return statistics.quantiles([t for t, _ in results], n=100, method="inclusive")[98]
