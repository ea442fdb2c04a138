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
a pool breaker at level 2 (rate limit); a worker's ``share`` (``policy.worker_share``)
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
(``_Worker.prefill_pending``). Without a learned rate
nothing drains until the next report, so ``prefill_steps`` must cover about one report
interval of prefill or it throttles below what the engine does.

**Placement** (``RoundBudget.take``): where workers report the dispatch partitions they
own (``WorkerHeartbeat.partitions``), admission chooses each request's worker and
produces it to one of that worker's partitions; every budget then holds per worker
too (``worker_views``). A session's request goes to its session's worker while that
one has room (affinity only then); otherwise a short request goes to the worker with
the fewest whole engine steps of prefill queued — each of its tokens waits behind them
— then the least loaded (the fullest of its dimensions), and a long prompt
(``long_prompt_tokens``) to the least loaded. Workers that report no partitions leave
the record's key to choose.

**VIP reserve** (``RoundBudget``): in every dimension, non-VIP work must leave
``vip_reserve`` of the budget free; only VIP requests may use it. A VIP arriving in a
burst finds room on the engines at once instead of waiting for bulk work to finish.
Whatever its size, one request always fits a dimension that holds nothing (a prompt
larger than the prefill budget is not stuck forever).

A pool with no live worker has no capacity: its work waits (and expires at its
deadline). A dimension no live worker has reported (``kv_capacity_tokens`` 0, a
worker without ``EngineStats`` yet) does not limit.

``max_model_len`` is the longest sequence every live worker of a pool can run (the
smallest their ``EngineStats`` report): what admission checks a request's prompt plus
``max_tokens`` against before it costs any quota.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from schemas import EngineStats, TelemetryEvent, WorkerHeartbeat, WorkerReport
from services.admission.cost import NO_COST, Cost
from services.admission.ledger import Ledger

WorkerStatus = Literal["starting", "serving", "draining", "stopped"]
_ABSORBING: frozenset[WorkerStatus] = frozenset({"starting", "serving"})


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    worker_timeout_s: float = 10.0
    slack: int = 2
    ledger_ttl_s: float = 600.0
    prefill_steps: float = 4.0
    """Prompt tokens waiting for their first token, per worker, in engine steps'
    worth (``max_num_batched_tokens`` each)."""
    kv_fill: float = 0.9
    """The share of a worker's KV cache reservations may fill, before ``kv_scale``."""
    kv_high: float = 0.9
    kv_step: float = 0.05
    kv_backoff: float = 0.7
    kv_scale_min: float = 0.3
    kv_scale_max: float = 1.5
    long_prompt_tokens: int = 1024
    """Placement: a prompt this long goes to the least loaded worker, a shorter one
    where the fewest prefill steps queue (0: every request to the least loaded)."""
    prefill_rate_decay: float = 0.05
    """A worker's learned prefill rate is the peak of its busy intervals' throughput (a
    queue at both ends does not mean the engine was prefilling all along, so a sample
    may measure the load, never more than the capacity), forgotten by this share per
    busy interval (an engine that slows down is followed)."""
    vip_reserve: float = 0.0
    """The share of every budget only VIP requests may use (off by default: see
    ``AdmissionSettings.vip_reserve``)."""

    def __post_init__(self) -> None:
        if self.worker_timeout_s <= 0 or self.ledger_ttl_s <= 0 or self.slack < 0:
            raise ValueError("timeouts must be positive and the slack not negative")
        if self.prefill_steps <= 0 or not 0 < self.kv_fill <= 1 or not 0 < self.kv_high <= 1:
            raise ValueError("prefill_steps must be positive, kv_fill and kv_high in (0, 1]")
        if not 0 < self.kv_scale_min <= 1 <= self.kv_scale_max or self.kv_step < 0:
            raise ValueError("need 0 < kv_scale_min <= 1 <= kv_scale_max and kv_step >= 0")
        if not 0 < self.kv_backoff < 1 or not 0 <= self.vip_reserve < 1:
            raise ValueError("kv_backoff must lie in (0, 1) and vip_reserve in [0, 1)")


@dataclass(slots=True)
class _Worker:
    pool: str
    batch_limit: int
    in_flight: int
    reported_at: float
    """When its latest ``in_flight`` report was read."""
    heard_at: float
    """When anything of it was last read (liveness)."""
    status: WorkerStatus = "serving"
    completed_since_report: int = 0
    """Completions its latest report does not reflect."""
    completed_total: int = 0
    """``completed_total`` of its latest report."""
    completed_seq: int = 0
    """The highest ``seq`` of its completions read."""
    engine: Engine | None = None
    """From its latest ``EngineStats``; ``None`` until one says."""
    kv_scale: float = 1.0
    preempted_total: int | None = None
    partitions: tuple[int, ...] = ()
    """The pool's dispatch partitions it owns, from its latest heartbeat."""
    engine_at: float = 0.0
    """When its latest ``EngineStats`` was read."""
    prefill_rate: float | None = None
    """Prompt tokens per second its engine prefills when it has a queue (learned)."""

    def budgets(self, part: float, c: CapacityConfig) -> tuple[int, int, int]:
        """Its batch slots, KV and prefill budgets at ``part`` of its capacity (the pool
        breaker's factor times its own share); token budgets 0 without ``EngineStats``."""
        slots = max(1, math.floor(self.batch_limit * part))
        e = self.engine
        if e is None:
            return slots, 0, 0
        kv = math.floor(e.kv_capacity_tokens * c.kv_fill * self.kv_scale * part)
        return slots, kv, math.floor(e.max_num_batched_tokens * c.prefill_steps * part)

    def prefill_pending(self, now: float, since_report: int = 0) -> int:
        """Its prefill queue now: reported, plus ``since_report`` tokens placed on it
        since, drained at its learned rate for the time since the report."""
        if self.engine is None:
            return since_report
        drained = (self.prefill_rate or 0.0) * max(0.0, now - self.engine_at)
        return max(0, math.ceil(self.engine.prefill_pending_tokens + since_report - drained))


@dataclass(frozen=True, slots=True)
class Engine:
    """What a worker's ``EngineStats`` says of its engine's token capacity and use."""

    kv_capacity_tokens: int = 0
    max_num_batched_tokens: int = 0
    kv_cache_usage: float = 0.0
    prefill_pending_tokens: int = 0
    preempted_total: int = 0
    prefilled_tokens_total: int = 0


@dataclass(slots=True)
class _Pool:
    ledger: Ledger = field(default_factory=Ledger)
    """This instance's dispatches to the pool that are not completed yet."""


@dataclass(frozen=True, slots=True)
class PoolView:
    """One pool's figures, as the pacing rule saw them. A budget of 0 with a dimension
    no live worker reported means "not limited" (see ``limited``)."""

    workers: int
    slots: int
    in_pool: int
    free: int
    kv_budget: int = 0
    kv_in_pool: int = 0
    prefill_budget: int = 0
    prefill_in_pool: int = 0

    @property
    def kv_limited(self) -> bool:
        return self.kv_budget > 0

    @property
    def prefill_limited(self) -> bool:
        return self.prefill_budget > 0


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker's figures (the pool's rule, per worker), where workers report the
    dispatch partitions they own and admission places each request on one of them."""

    worker_id: str
    partitions: tuple[int, ...]
    slots: int
    in_pool: int
    kv_budget: int
    kv_in_pool: int
    prefill_budget: int
    prefill_in_pool: int
    step_tokens: int = 0
    """Its engine's ``max_num_batched_tokens`` (0: not reported)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request goes: a worker of a pool, and the partition of its it is
    produced to."""

    pool: str
    worker_id: str
    partition: int


class _Room:
    """A worker's budget in a round."""

    def __init__(self, view: WorkerView, slack: int) -> None:
        self.view = view
        self.slack = slack
        self.in_pool = view.in_pool
        self.kv = view.kv_in_pool
        self.prefill = view.prefill_in_pool

    def fits(self, cost: Cost, keep: float) -> bool:
        v = self.view
        free = v.slots + self.slack - self.in_pool
        budgets = (v.slots, v.kv_budget, v.prefill_budget)
        return _fits(cost, keep, free, budgets, self.kv, self.prefill)

    def take(self, cost: Cost) -> None:
        self.in_pool += 1
        self.kv += cost.kv_tokens
        self.prefill += cost.prompt_tokens

    @property
    def prefill_steps(self) -> int:
        """Whole engine steps of prefill queued on it: what a short request waits for."""
        step = self.view.step_tokens
        return self.prefill // step if step else 0

    @property
    def load(self) -> float:
        """How full it is, the fullest dimension first: what placement balances."""
        v = self.view
        shares = [self.in_pool / v.slots if v.slots else 1.0]
        if v.kv_budget:
            shares.append(self.kv / v.kv_budget)
        if v.prefill_budget:
            shares.append(self.prefill / v.prefill_budget)
        return max(shares) + sum(shares) / 1000  # ties go to the emptier overall


class RoundBudget:
    """What one dispatch round may still send to a pool, dimension by dimension, with
    the VIP reserve (see the module docstring). ``take`` each request dispatched.

    Where the pool's workers report the partitions they own (``workers``), every
    request must also fit one worker, and ``take`` places it: on the worker of its
    session's partition while that one has room (affinity only then), else on the
    least loaded worker it fits (``_Room.load``). Without them, it returns
    ``None`` and the record's key picks its partition (and worker)."""

    def __init__(
        self,
        view: PoolView,
        vip_reserve: float,
        max_requests: int | None = None,
        workers: Sequence[WorkerView] = (),
        slack: int = 0,
        pool: str = "",
        long_prompt: int = 0,
    ):
        self._pool = pool
        self._long_prompt = long_prompt
        self._view = view
        self._reserve = vip_reserve
        self._slots_free = view.free if max_requests is None else min(view.free, max_requests)
        self._kv = view.kv_in_pool
        self._prefill = view.prefill_in_pool
        self._rooms = [_Room(w, slack) for w in workers if w.partitions]
        self._owner = {p: room for room in self._rooms for p in room.view.partitions}
        self._partitions = sorted(self._owner)

    def _keep(self, vip: bool, headroom: float) -> float:
        return 0.0 if vip else max(self._reserve, headroom)

    def fits(self, cost: Cost, vip: bool, headroom: float = 0.0) -> bool:
        """Whether ``cost`` fits now: VIP into the whole budget; anything else leaving
        the VIP reserve free, or ``headroom`` of every budget if that is larger (what
        the scavenger lane leaves for the work that may arrive next)."""
        keep = self._keep(vip, headroom)
        v = self._view
        budgets = (v.slots, v.kv_budget, v.prefill_budget)
        if not _fits(cost, keep, self._slots_free, budgets, self._kv, self._prefill):
            return False
        return not self._rooms or any(room.fits(cost, keep) for room in self._rooms)

    def take(
        self,
        cost: Cost,
        vip: bool = False,
        headroom: float = 0.0,
        key: str = "",
        session: str | None = None,
    ) -> Placement | None:
        """Charge ``cost`` (which ``fits``) and place it: ``key`` is the record's key
        (spreads it over its worker's partitions), ``session`` its session, if any."""
        self._slots_free -= 1
        self._kv += cost.kv_tokens
        self._prefill += cost.prompt_tokens
        if not self._rooms:
            return None
        keep = self._keep(vip, headroom)
        room: _Room | None = None
        home: int | None = None
        if session is not None:
            home = self._partitions[zlib.crc32(session.encode()) % len(self._partitions)]
            room = self._owner[home]
        if room is None or not room.fits(cost, keep):
            fitting = [r for r in self._rooms if r.fits(cost, keep)] or self._rooms
            if self._long_prompt and cost.prompt_tokens >= self._long_prompt:
                room = min(fitting, key=lambda r: r.load)
            else:
                room = min(fitting, key=lambda r: (r.prefill_steps, r.load))
        room.take(cost)
        parts = room.view.partitions
        if home not in parts:
            home = parts[zlib.crc32(key.encode()) % len(parts)]
        return Placement(self._pool, room.view.worker_id, home)


def _fits(
    cost: Cost, keep: float, free: int, budgets: tuple[int, int, int], kv: int, prefill: int
) -> bool:
    """The pacing rule for one more request, in a pool or on one worker: a slot left
    after ``keep`` of the ``(slots, kv, prefill)`` budgets, and its tokens within the
    token budgets less ``keep`` (a token budget of 0 is not reported: it does not
    limit)."""
    slots, kv_budget, prefill_budget = budgets
    if free - math.floor(slots * keep) < 1:
        return False
    if kv_budget and not _within(kv, cost.kv_tokens, kv_budget * (1 - keep)):
        return False
    return not prefill_budget or _within(prefill, cost.prompt_tokens, prefill_budget * (1 - keep))


def _within(used: int, cost: int, budget: float) -> bool:
    """``cost`` more fits ``budget``; anything fits a dimension that holds nothing."""
    return used == 0 or used + cost <= budget


class FleetCapacity:
    """The pools' free capacity, from telemetry and this instance's own dispatches.

    ``now`` is a monotonic reading of the caller's clock (when a record was read), never
    a worker's timestamp, so clock skew between hosts does not matter.
    """

    def __init__(self, config: CapacityConfig | None = None) -> None:
        self.config = config or CapacityConfig()
        self._workers: dict[str, _Worker] = {}
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
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker(pool, batch_limit, in_flight, now, now)
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

    def _learn_prefill_rate(self, w: _Worker, engine: Engine, now: float) -> None:
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

    def _correct_kv(self, w: _Worker, engine: Engine) -> None:
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
            if event.limits.max_model_len:
                self._model_lens[event.worker_id] = event.limits.max_model_len
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
        """A ``RequestCompleted``: the slot is free, and the request leaves the ledger.
        Numbered (``seq`` > 0), it counts against the worker's latest report only if
        that report does not reflect it; unnumbered, it counts as read after it."""
        w = self._workers.get(worker_id)
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
        if not 0.0 <= factor <= 1.0:
            raise ValueError("factor must lie in [0, 1]")
        c = self.config
        ledger = self._pool(pool).ledger
        ledger.expire(now - c.ledger_ttl_s)
        live = self._live(pool, now)
        if not live:
            return PoolView(0, 0, len(ledger), 0)
        slots = kv_budget = prefill_budget = 0
        reported = reported_kv = 0
        for wid, w in live:
            w_slots, w_kv, w_prefill = w.budgets(factor * self._shares.get(wid, 1.0), c)
            slots += w_slots
            kv_budget += w_kv
            prefill_budget += w_prefill
            reported += max(0, w.in_flight - w.completed_since_report)
            e = w.engine
            if e is not None:
                reported_kv += math.ceil(e.kv_cache_usage * e.kv_capacity_tokens)
        _, unreflected = ledger.since({}, others=min(w.reported_at for _, w in live))
        prefill_in_pool = self._prefill_in_pool(live, ledger, now)
        in_pool = max(len(ledger), reported + unreflected.requests)
        return PoolView(
            workers=len(live),
            slots=slots,
            in_pool=in_pool,
            free=max(0, slots + c.slack - in_pool),
            kv_budget=kv_budget,
            kv_in_pool=max(ledger.total.kv_tokens, reported_kv + unreflected.kv_tokens),
            prefill_budget=prefill_budget,
            prefill_in_pool=prefill_in_pool,
        )

    def free(self, pool: str, now: float, factor: float = 1.0) -> int:
        return self.view(pool, now, factor).free

    @staticmethod
    def _prefill_in_pool(live: list[tuple[str, _Worker]], ledger: Ledger, now: float) -> int:
        """Σ each worker's prefill queue (``_Worker.prefill_pending``) with the prompts
        placed on it since its report, plus the prompts dispatched by key since the
        oldest report (not drained: where they went is not known)."""
        engine_at = {wid: w.engine_at for wid, w in live}
        placed, by_key = ledger.since(engine_at, others=min(engine_at.values()))
        return by_key.prompt_tokens + sum(
            w.prefill_pending(now, placed[wid].prompt_tokens) for wid, w in live
        )

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
        c = self.config
        live = self._live(pool, now)
        ledger = self._pool(pool).ledger
        unreported, _ = ledger.since({wid: w.reported_at for wid, w in live})
        unprefilled, _ = ledger.since({wid: w.engine_at for wid, w in live})
        views = []
        for wid, w in live:
            slots, kv_budget, prefill_budget = w.budgets(factor * self._shares.get(wid, 1.0), c)
            placed, new = ledger.placed_on(wid), unreported[wid]
            e = w.engine or Engine()
            views.append(
                WorkerView(
                    worker_id=wid,
                    partitions=w.partitions,
                    slots=slots,
                    in_pool=max(
                        placed.requests,
                        max(0, w.in_flight - w.completed_since_report) + new.requests,
                    ),
                    kv_budget=kv_budget,
                    kv_in_pool=max(
                        placed.kv_tokens,
                        math.ceil(e.kv_cache_usage * e.kv_capacity_tokens) + new.kv_tokens,
                    ),
                    prefill_budget=prefill_budget,
                    prefill_in_pool=w.prefill_pending(now, unprefilled[wid].prompt_tokens),
                    step_tokens=e.max_num_batched_tokens,
                )
            )
        return views

    def budget(
        self, pool: str, now: float, factor: float = 1.0, max_requests: int | None = None
    ) -> tuple[PoolView, RoundBudget]:
        """The pool's view, and the budget of a dispatch round on it (placing requests
        on workers where they report their partitions)."""
        c = self.config
        view = self.view(pool, now, factor)
        workers = self.worker_views(pool, now, factor)
        slack = 1 if c.slack else 0
        budget = RoundBudget(
            view, c.vip_reserve, max_requests, workers, slack, pool, c.long_prompt_tokens
        )
        return view, budget

    def model_lens(self, now: float) -> dict[str, int]:
        """Per pool, the ``max_model_len`` every live worker can run (pools whose
        workers have not reported one are left out)."""
        lens: dict[str, int] = {}
        for pool in {w.pool for w in self._workers.values()}:
            known = [
                self._model_lens[wid] for wid, _ in self._live(pool, now) if wid in self._model_lens
            ]
            if known:
                lens[pool] = min(known)
        return lens

    # -- internals -------------------------------------------------------------------
    def _pool(self, pool: str) -> _Pool:
        return self._pools.setdefault(pool, _Pool())

    def _live(self, pool: str, now: float) -> list[tuple[str, _Worker]]:
        silent = [
            wid
            for wid, w in self._workers.items()
            if now - w.heard_at > self.config.worker_timeout_s
        ]
        for wid in silent:  # forgotten; a report brings a worker back
            del self._workers[wid]
            self._model_lens.pop(wid, None)
        return [
            (wid, w)
            for wid, w in self._workers.items()
            if w.pool == pool and w.status in _ABSORBING and self._shares.get(wid, 1.0) > 0
        ]
