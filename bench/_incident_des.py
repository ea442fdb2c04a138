"""Virtual time for the incident benchmark: an event loop, engines stepped on it, and
what each client saw.

``Loop`` is a discrete-event loop (a heap of timed callbacks, first in first out at equal
times): nothing sleeps, so a few minutes of a fleet run in seconds on one core and a run
is a function of its inputs. ``VirtualEngine`` drives a ``SimCore`` on it exactly as
``services.workers.engine.sim`` drives one in real time: a step scheduled at ``now``
takes its simulated duration, its tokens exist at its end, and the next step follows at
once while work remains; a request added mid-step waits for the next step, as in vLLM.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

from _incident_scenario import EPOCH, Arrival

from services.workers.engine.base import FinishReason
from services.workers.engine.sim_core import SimCore, StepResult

Kind = Literal["ok", "degraded", "static", "rejected", "expired", "timed_out"]
"""What a client got: an answer from a model (``ok``, or ``degraded`` by admission:
small model, truncated, quota-degraded), the canned reply (``static``), an immediate
refusal (``rejected``), an ``expired`` reply after its deadline, or nothing before it
gave up (``timed_out``: in the uncontrolled run its request was aborted then; under
seawall the answer came too late)."""


class Loop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.now + dt, fn)

    def every(self, period: float, fn: Callable[[], None], *, start: float, until: float) -> None:
        """``fn`` at ``start``, then every ``period`` while before ``until``."""

        def tick() -> None:
            fn()
            if self.now + period < until:
                self.after(period, tick)

        self.at(start, tick)

    def run(self) -> None:
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            fn()


class VirtualClock:
    """``seawall_client.clock.Clock`` on the loop: epoch seconds and monotonic seconds."""

    def __init__(self, loop: Loop) -> None:
        self._loop = loop

    def time(self) -> float:
        return EPOCH + self._loop.now

    def monotonic(self) -> float:
        return self._loop.now


OnDone = Callable[[str, FinishReason, int, float | None], None]
"""(request id, finish reason, output tokens, time of its first token)."""


class VirtualEngine:
    def __init__(self, loop: Loop, core: SimCore, on_done: OnDone) -> None:
        self.loop = loop
        self.core = core
        self._on_done = on_done
        self._busy = False
        self._tokens: dict[str, int] = {}
        self._first: dict[str, float] = {}
        self._prefill: dict[str, int] = {}
        """Prompt tokens of the requests with no first token yet."""
        self.prefilled_tokens_total = 0

    @property
    def in_flight(self) -> int:
        return len(self._tokens)

    @property
    def prefill_pending_tokens(self) -> int:
        """What a seawall worker reports in ``EngineStats.prefill_pending_tokens``."""
        return sum(self._prefill.values())

    def add(self, request_id: str, prompt_tokens: int, max_tokens: int, priority: int) -> None:
        self.core.add(request_id, prompt_tokens, max_tokens, now=self.loop.now, priority=priority)
        self._tokens[request_id] = 0
        self._prefill[request_id] = prompt_tokens
        if not self._busy:
            self._busy = True
            self.loop.at(self.loop.now, self._step)

    def abort(self, request_id: str) -> None:
        if self._tokens.pop(request_id, None) is not None:
            self._first.pop(request_id, None)
            self._prefill.pop(request_id, None)
            self.core.abort(request_id)

    def _step(self) -> None:
        result = self.core.step(self.loop.now)
        if result.idle:
            self._busy = False
            return
        self.loop.after(result.duration_ms / 1000.0, lambda: self._deliver(result))

    def _deliver(self, result: StepResult) -> None:
        now, tokens = self.loop.now, self._tokens
        for request_id, n in result.new_tokens.items():
            if request_id in tokens:  # not aborted while the step ran
                tokens[request_id] += n
        for request_id in result.first_token:
            if request_id in tokens:
                self._first[request_id] = now
                self.prefilled_tokens_total += self._prefill.pop(request_id, 0)
        for request_id, reason in result.finished.items():
            if request_id in tokens:
                self._prefill.pop(request_id, None)
                self._on_done(
                    request_id, reason, tokens.pop(request_id), self._first.pop(request_id, None)
                )
        self._step()


@dataclass(frozen=True, slots=True)
class Outcome:
    arrival: Arrival
    kind: Kind
    reason: str
    """The reply's reason code (``none`` for a plain answer), or ``client_timeout``."""
    latency: float | None
    """Arrival → the reply at the client, seconds; a request its client gave up on
    (``timed_out``, ``expired``) counts at its timeout, what its client waited; ``None``
    for refusals."""

    @property
    def answered(self) -> bool:
        """An answer from a model, in time."""
        return self.kind in ("ok", "degraded")


@dataclass(frozen=True, slots=True)
class Replica:
    """What a router or a gate in front of the engines sees of one of them."""

    in_flight: int
    waiting: int
    kv_cache_usage: float


Pick = Callable[[Sequence[Replica], Arrival], int]
"""A router: the index of the replica a request goes to."""
Admit = Callable[[float, Arrival, Sequence[Replica]], bool]
"""A gate: whether a request (at this time, beside these replicas) is admitted."""


def serve(
    arrivals: Sequence[Arrival],
    engines: list[SimCore],
    timeout_s: float,
    pick: Pick,
    admit: Admit,
    priority_of: Callable[[Arrival], int] = lambda a: 0,
    refresh_s: float | None = None,
) -> list[Outcome]:
    """Requests straight to engines, through whatever stands in front of them: ``admit``
    refuses a request at once or lets it in, ``pick`` chooses its engine, each from a
    view of the replicas (as they are, or as scraped every ``refresh_s``). An engine
    queues what it cannot run; a client that times out disconnects and the server
    aborts its request, as vLLM's OpenAI server does."""
    loop = Loop()
    outcomes: dict[int, Outcome] = {}
    by_id = {a.request_id: a for a in arrivals}
    where: dict[str, VirtualEngine] = {}

    def done(request_id: str, _reason: FinishReason, _tokens: int, _first: float | None) -> None:
        a = by_id[request_id]
        del where[request_id]
        outcomes[a.index] = Outcome(a, "ok", "none", loop.now - a.at)

    fleet = [VirtualEngine(loop, core, done) for core in engines]

    def view() -> list[Replica]:
        out = []
        for e in fleet:
            stats = e.core.stats(loop.now)
            out.append(Replica(e.in_flight, stats.waiting, stats.kv_cache_usage))
        return out

    seen = [view()]
    if refresh_s is not None and arrivals:
        until = max(a.at for a in arrivals)
        loop.every(refresh_s, lambda: seen.__setitem__(0, view()), start=0.0, until=until)

    def arrive(a: Arrival) -> None:
        replicas = seen[0] if refresh_s is not None else view()
        if not admit(loop.now, a, replicas):
            outcomes[a.index] = Outcome(a, "rejected", "peer_refused", None)
            return
        engine = fleet[pick(replicas, a)]
        engine.add(a.request_id, a.prompt_tokens, a.max_tokens, priority_of(a))
        where[a.request_id] = engine
        loop.after(timeout_s, partial(give_up, a))

    def give_up(a: Arrival) -> None:
        engine = where.pop(a.request_id, None)
        if engine is not None:
            engine.abort(a.request_id)
            outcomes[a.index] = Outcome(a, "timed_out", "client_timeout", timeout_s)

    for a in arrivals:
        loop.at(a.at, partial(arrive, a))
    loop.run()
    return [outcomes[a.index] for a in arrivals]


def least_loaded(replicas: Sequence[Replica], _arrival: Arrival) -> int:
    """The replica with the fewest requests in flight (the first of equals)."""
    return min(range(len(replicas)), key=lambda i: replicas[i].in_flight)


def run_uncontrolled(
    arrivals: Sequence[Arrival], engines: list[SimCore], timeout_s: float
) -> list[Outcome]:
    """(a) No control plane: every request goes straight to the engine with the fewest
    requests in flight (a least-outstanding-requests balancer), which queues what it
    cannot run (its batch limit is ``max_num_seqs``), all at one priority."""
    return serve(arrivals, engines, timeout_s, least_loaded, lambda *_: True)
