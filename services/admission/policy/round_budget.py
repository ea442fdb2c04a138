"""What one dispatch round may still send to a pool, and where each request goes (pure).

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
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from services.admission.policy.cost import Cost


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
