"""How much work each pool can absorb now, in the engine's own units: the pacing rule
of admission (pure).

Admission dispatches to a pool only what its workers can absorb, so the pool's dispatch
topic never holds more than a few records: a burst of bulk work waits in admission, in
priority order, and a VIP request arriving later overtakes it there. "Absorb" has three
dimensions, each a budget over the pool's *live* workers and an estimate of what is in
the pool now; a request is dispatched only when it fits all three:

- **batch slots**: ``Σ max(1, ⌊batch_limit × factor × share⌋) + slack`` against the
  requests dispatched and not finished;
- **KV tokens**: ``Σ ⌊kv_capacity_tokens × kv_fill × kv_scale × factor × share⌋``
  against the tokens reserved for the requests in the pool, each ``prompt +
  max_tokens`` (the most its sequence can hold). A long-prompt burst stops here before
  it floods a worker's KV cache into preemptions;
- **prefill tokens**: ``Σ max_num_batched_tokens × prefill_steps × factor × share``
  against the prompt tokens waiting for their first token: the prefill work queued in
  the engines, which every newcomer's TTFT waits behind (a VIP's included: vLLM's
  priority policy reorders the waiting queue, but running prefills keep their turn).

Live workers: heard from (``EngineStats`` or ``WorkerHeartbeat``) within
``worker_timeout_s``, last heartbeat status ``starting`` or ``serving`` (not
``draining`` or ``stopped``), and with a share above 0. ``factor`` is 1, or less under
a pool breaker at level 2 (rate limit); a worker's ``share`` (``routing.worker_share``)
is 1, less under its own rate-limiting breaker, 0 when its breaker isolates it.
``slack`` lets a worker find its next record already waiting when a slot frees.

What is in the pool is the larger of two estimates (the prefill dimension has only the
first: no completion says when a prompt's prefill ended):

- *telemetry*: each worker's latest report (``in_flight`` minus the completions read
  since that the report did not yet reflect — completions are numbered per worker
  (``RequestCompleted.seq``) and a report says how many it reflects
  (``completed_total``), so no order between the two topics and no clocks matter;
  ``kv_cache_usage × kv_capacity_tokens``; its
  ``prefill_pending_tokens``) plus our dispatches made after the oldest of those
  reports was received (not yet reflected in any report; a conservative count);
- *ledger*: the dispatches of this admission instance with no ``RequestCompleted`` yet
  (by request id, with their cost; forgotten after ``ledger_ttl_s`` in case a
  completion is lost).

The ledger is exact for one admission instance, including records still waiting in
Kafka, which the telemetry cannot see; the telemetry covers the other instances'
dispatches (up to one report interval late) and a request's real KV use.

``kv_scale`` corrects each worker's KV budget by what its engine reports, additive
increase, multiplicative decrease: a report with new preemptions multiplies it by
``kv_backoff`` (down to ``kv_scale_min``); a report with ``kv_cache_usage`` under
``kv_high`` and no new preemption adds ``kv_step`` (up to ``kv_scale_max``, above 1:
reservations count ``max_tokens`` in full while most requests stop earlier, so a worker
whose cache stays cool may hold more than its reservations say).

A worker's prefill queue drains between its reports: from two ``EngineStats`` that
both found a queue, ``prefilled_tokens_total`` gives the rate its engine prefills at
(the peak of such intervals, slowly forgotten); the queue it reported, plus the prompts
placed on it since, is drained at that rate for the time since
(``WorkerState.prefill_pending``). Without a learned rate
nothing drains until the next report, so ``prefill_steps`` must cover about one report
interval of prefill or it throttles below what the engine does.

A pool with no live worker has no capacity: its work waits (and expires at its
deadline). A dimension no live worker has reported (``kv_capacity_tokens`` 0, a
worker without ``EngineStats`` yet) does not limit.

``max_model_len`` is the longest sequence every live worker of a pool can run (the
smallest their ``EngineStats`` report): what admission checks a request's prompt plus
``max_tokens`` against before it costs any quota.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from schemas import EngineStats, TelemetryEvent, WorkerHeartbeat, WorkerReport
from services.admission.policy.cost import NO_COST, Cost
from services.admission.policy.ledger import Ledger
from services.admission.policy.round_budget import PoolView, RoundBudget, WorkerView
from services.admission.policy.workers import (
    CapacityConfig,
    Engine,
    WorkerState,
    WorkerStatus,
)

_ABSORBING: frozenset[WorkerStatus] = frozenset({"starting", "serving"})
FORGET_EVERY_S = 1.0
"""How often the workers gone silent are looked for (and forgotten)."""
NO_ENGINE = Engine()
"""A worker that sent no ``EngineStats`` yet: no token figures."""


@dataclass(slots=True)
class _Pool:
    ledger: Ledger = field(default_factory=Ledger)
    """This instance's dispatches to the pool that are not completed yet."""


class FleetCapacity:
    """The pools' free capacity, from telemetry and this instance's own dispatches.

    ``now`` is a monotonic reading of the caller's clock (when a record was read), never
    a worker's timestamp, so clock skew between hosts does not matter.
    """

    def __init__(self, config: CapacityConfig | None = None) -> None:
        self.config = config or CapacityConfig()
        self._workers: dict[str, WorkerState] = {}
        self._by_pool: dict[str, dict[str, WorkerState]] = {}
        """The same workers by pool: a round walks its pool's, not the fleet's."""
        self._forgotten_at = -math.inf
        self._shares: dict[str, float] = {}
        self._pools: dict[str, _Pool] = {}
        self._model_lens: dict[str, int] = {}
        """Worker id → the ``max_model_len`` its engine reported."""

    # -- inputs ------------------------------------------------------------------
    def report(
        self,
        worker_id: str,
        pool: str,
        *,
        batch_limit: int,
        in_flight: int,
        now: float,
        status: WorkerStatus | None = None,
        engine: Engine | None = None,
        partitions: tuple[int, ...] | None = None,
        completed_total: int = 0,
    ) -> None:
        """An ``EngineStats`` (``status=None``, with ``engine``) or a ``WorkerHeartbeat``
        (with ``status`` and the ``partitions`` it owns)."""
        w = self._heard_from(worker_id, now)
        if w is None:
            w = self._workers[worker_id] = WorkerState(pool, batch_limit, in_flight, now, now)
            self._by_pool.setdefault(pool, {})[worker_id] = w
        elif w.pool != pool:  # moved to another pool
            del self._by_pool[w.pool][worker_id]
            self._by_pool.setdefault(pool, {})[worker_id] = w
        w.pool, w.batch_limit, w.in_flight = pool, batch_limit, in_flight
        w.reported_at = w.heard_at = now
        if completed_total < w.completed_total:
            w.completed_seq = 0  # a restarted worker counts from 0 again
        w.completed_total = completed_total
        w.completed_since_report = max(0, w.completed_seq - completed_total)
        if status is not None:
            w.status = status
        if partitions is not None:
            w.partitions = partitions
        if engine is not None:
            self._correct_kv(w, engine)
            self._learn_prefill_rate(w, engine, now)
            w.engine, w.engine_at = engine, now

    def _learn_prefill_rate(self, w: WorkerState, engine: Engine, now: float) -> None:
        """The peak prefill throughput of report intervals that had a queue at both
        ends (an interval that did not measures only the load), slowly forgotten."""
        before = w.engine
        if before is None or now <= w.engine_at:
            return
        done = engine.prefilled_tokens_total - before.prefilled_tokens_total
        if done < 0 or not (before.prefill_pending_tokens and engine.prefill_pending_tokens):
            return  # a restarted worker, or an interval it was not busy throughout
        sample = done / (now - w.engine_at)
        forgotten = (w.prefill_rate or 0.0) * (1 - self.config.prefill_rate_decay)
        w.prefill_rate = max(sample, forgotten)

    def _correct_kv(self, w: WorkerState, engine: Engine) -> None:
        """AIMD on the worker's ``kv_scale`` (module docstring)."""
        c = self.config
        before, w.preempted_total = w.preempted_total, engine.preempted_total
        if before is None:
            return  # the first report: nothing to compare with yet
        if engine.preempted_total > before:
            w.kv_scale = max(c.kv_scale_min, w.kv_scale * c.kv_backoff)
        elif engine.kv_cache_usage < c.kv_high:
            w.kv_scale = min(c.kv_scale_max, w.kv_scale + c.kv_step)

    def observe(self, event: TelemetryEvent, now: float) -> None:
        """A telemetry record, whatever its kind (those that say nothing of capacity are
        ignored): what admission's telemetry loop feeds."""
        if isinstance(event, EngineStats):
            engine = Engine(
                kv_capacity_tokens=event.limits.kv_capacity_tokens,
                max_num_batched_tokens=event.limits.max_num_batched_tokens,
                kv_cache_usage=event.kv_cache_usage,
                prefill_pending_tokens=event.prefill_pending_tokens,
                preempted_total=event.preempted_total,
                prefilled_tokens_total=event.prefilled_tokens_total,
            )
            self.report(
                event.worker_id,
                event.pool,
                batch_limit=event.batch_limit,
                in_flight=event.in_flight,
                now=now,
                engine=engine,
                completed_total=event.completed_total,
            )
            if event.limits.max_model_len:
                self._model_lens[event.worker_id] = event.limits.max_model_len
        elif isinstance(event, WorkerHeartbeat):
            self.report(
                event.worker_id,
                event.pool,
                batch_limit=event.batch_limit,
                in_flight=event.in_flight,
                now=now,
                status=event.status,
                partitions=event.partitions,
                completed_total=event.completed_total,
            )
        elif isinstance(event, WorkerReport):
            for part in event.parts():
                self.observe(part, now)

    def completed(self, worker_id: str, request_id: str, now: float, seq: int = 0) -> None:
        """A ``RequestCompleted``: the slot is free, and the request (``request_id``: its
        ``scoped_id``) leaves the ledger.
        Numbered (``seq`` > 0), it counts against the worker's latest report only if
        that report does not reflect it; unnumbered, it counts as read after it."""
        w = self._heard_from(worker_id, now)
        if w is not None:
            if seq:
                w.completed_seq = max(w.completed_seq, seq)
                w.completed_since_report = max(0, w.completed_seq - w.completed_total)
            else:
                w.completed_since_report += 1
            w.heard_at = now
            self._pool(w.pool).ledger.pop(request_id)
        else:
            for p in self._pools.values():
                p.ledger.pop(request_id)

    def forget(self, request_id: str) -> None:
        """A dispatch that holds no slot any more though no completion will come for it
        (a copy of a request already answered, ``RequestCompleted.repeat``): out of the
        ledger, whichever pool holds it. Left there, it held its slot for
        ``ledger_ttl_s``: a restarted admission re-dispatches what its predecessor had
        not committed, and those copies filled a small pool's ledger until nothing more
        was dispatched (seen in CI: 81 of 120 requests answered, then a stall)."""
        for p in self._pools.values():
            p.ledger.pop(request_id)

    def share(self, worker_id: str, share: float) -> None:
        """The part of its batch slots a worker's breaker leaves it: 1 all, 0 isolated."""
        if not 0.0 <= share <= 1.0:
            raise ValueError("a share lies in [0, 1]")
        if share == 1.0:
            self._shares.pop(worker_id, None)
        else:
            self._shares[worker_id] = share

    def dispatched(
        self,
        pool: str,
        request_id: str,
        now: float,
        cost: Cost = NO_COST,
        worker: str | None = None,
    ) -> None:
        self._pool(pool).ledger.add(request_id, now, cost, worker)

    # -- the rule ------------------------------------------------------------------
    def view(self, pool: str, now: float, factor: float = 1.0) -> PoolView:
        return self._measure(pool, now, factor)[0]

    def free(self, pool: str, now: float, factor: float = 1.0) -> int:
        return self.view(pool, now, factor).free

    def prefill_rate(self, pool: str, now: float) -> tuple[float, int]:
        """Prompt tokens per second the pool's live workers prefill (the sum of the
        rates learned so far, 0 while none is) and one engine step's tokens on each."""
        live = self._live(pool, now)
        rate = sum(w.prefill_rate or 0.0 for _, w in live)
        step = sum(w.engine.max_num_batched_tokens for _, w in live if w.engine is not None)
        return rate, step

    def worker_views(self, pool: str, now: float, factor: float = 1.0) -> list[WorkerView]:
        """Each live worker's figures, the pool's rule applied to it alone: its budgets,
        and in it the larger of its ledger entries and its report plus the entries
        placed on it since."""
        return self._measure(pool, now, factor)[1]

    def budget(
        self, pool: str, now: float, factor: float = 1.0, max_requests: int | None = None
    ) -> tuple[PoolView, RoundBudget]:
        """The pool's view, and the budget of a dispatch round on it (placing requests
        on workers where they report their partitions)."""
        c = self.config
        view, workers = self._measure(pool, now, factor)
        slack = 1 if c.slack else 0
        budget = RoundBudget(
            view, c.vip_reserve, max_requests, workers, slack, pool, c.long_prompt_tokens
        )
        return view, budget

    def _measure(self, pool: str, now: float, factor: float) -> tuple[PoolView, list[WorkerView]]:
        """The pool's view and its workers' in one pass over its live workers: the
        pool's figures are the sums of theirs, and of what the ledger holds beyond
        them. In the pool's prefill queue, the prompts dispatched by key since the
        oldest ``EngineStats`` (not drained: where they went is not known)."""
        if not 0.0 <= factor <= 1.0:
            raise ValueError("factor must lie in [0, 1]")
        c = self.config
        ledger = self._pool(pool).ledger
        ledger.expire(now - c.ledger_ttl_s)
        live = self._live(pool, now)
        if not live:
            return PoolView(0, 0, len(ledger), 0), []
        engine_at = {wid: w.engine_at for wid, w in live}
        slots = kv_budget = prefill_budget = reported = reported_kv = 0
        prefill_in_pool = ledger.unplaced_since(engine_at, min(engine_at.values())).prompt_tokens
        views = []
        for wid, w in live:
            w_slots, w_kv, w_prefill = w.budgets(factor * self._shares.get(wid, 1.0), c)
            in_flight = max(0, w.in_flight - w.completed_since_report)
            e = w.engine or NO_ENGINE
            kv_used = math.ceil(e.kv_cache_usage * e.kv_capacity_tokens)
            placed, new, unprefilled = ledger.placed_on(wid, w.reported_at, w.engine_at)
            w_prefill_in = w.prefill_pending(now, unprefilled.prompt_tokens)
            views.append(
                WorkerView(
                    worker_id=wid,
                    partitions=w.partitions,
                    slots=w_slots,
                    in_pool=max(placed.requests, in_flight + new.requests),
                    kv_budget=w_kv,
                    kv_in_pool=max(placed.kv_tokens, kv_used + new.kv_tokens),
                    prefill_budget=w_prefill,
                    prefill_in_pool=w_prefill_in,
                    step_tokens=e.max_num_batched_tokens,
                )
            )
            slots += w_slots
            kv_budget += w_kv
            prefill_budget += w_prefill
            reported += in_flight
            reported_kv += kv_used
            prefill_in_pool += w_prefill_in
        # Dispatched after the oldest report: not reflected in every report (conservative).
        unreflected = ledger.newer_than(min(w.reported_at for _, w in live))
        in_pool = max(len(ledger), reported + unreflected.requests)
        view = PoolView(
            workers=len(live),
            slots=slots,
            in_pool=in_pool,
            free=max(0, slots + c.slack - in_pool),
            kv_budget=kv_budget,
            kv_in_pool=max(ledger.total.kv_tokens, reported_kv + unreflected.kv_tokens),
            prefill_budget=prefill_budget,
            prefill_in_pool=prefill_in_pool,
        )
        return view, views

    def model_lens(self, now: float) -> dict[str, int]:
        """Per pool, the ``max_model_len`` every live worker can run (pools whose
        workers have not reported one are left out)."""
        self._forget_silent(now)
        lens: dict[str, int] = {}
        for wid, length in self._model_lens.items():
            w = self._workers[wid]
            if self._absorbs(wid, w, now):
                lens[w.pool] = min(lens.get(w.pool, length), length)
        return lens

    # -- internals -------------------------------------------------------------------
    def _pool(self, pool: str) -> _Pool:
        found = self._pools.get(pool)
        if found is None:  # not setdefault: a _Pool (and its ledger) built per call
            found = self._pools[pool] = _Pool()
        return found

    def _heard_from(self, worker_id: str, now: float) -> WorkerState | None:
        """The worker heard from at ``now``, as known: ``None`` if unknown, or if silent
        past ``worker_timeout_s`` (forgotten now: it comes back as a new worker)."""
        w = self._workers.get(worker_id)
        if w is None:
            return None
        if self._silent(w, now):
            self._forget(worker_id)
            return None
        return w

    def _forget_silent(self, now: float) -> None:
        """Forget the workers not heard from within ``worker_timeout_s``, at most once a
        ``FORGET_EVERY_S`` (a walk of the whole fleet): until then a silent worker is
        kept, but not live (``_absorbs``), and forgotten when next heard from."""
        if now - self._forgotten_at < FORGET_EVERY_S:
            return
        self._forgotten_at = now
        for wid in [wid for wid, w in self._workers.items() if self._silent(w, now)]:
            self._forget(wid)

    def _forget(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id)
        del self._by_pool[w.pool][worker_id]
        self._model_lens.pop(worker_id, None)

    def _silent(self, w: WorkerState, now: float) -> bool:
        """Not heard from within ``worker_timeout_s``."""
        return now - w.heard_at > self.config.worker_timeout_s

    def _absorbs(self, worker_id: str, w: WorkerState, now: float) -> bool:
        """Live: not silent, starting or serving, and with a share of its slots above 0."""
        return (
            not self._silent(w, now)
            and w.status in _ABSORBING
            and self._shares.get(worker_id, 1.0) > 0
        )

    def _live(self, pool: str, now: float) -> list[tuple[str, WorkerState]]:
        self._forget_silent(now)
        workers = self._by_pool.get(pool, {})
        return [(wid, w) for wid, w in workers.items() if self._absorbs(wid, w, now)]
