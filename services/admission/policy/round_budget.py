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

A round keeps its workers ordered by those two keys (``_Order``: heaps whose entries
go stale when their worker takes a request), so that placing a request costs a look at
the least loaded workers, not a pass over the pool. With a pass per request, a round of
200 requests without a session (the usual request over HTTP) cost 41–44 µs a request
in a pool of 20 workers, 188–191 µs in one of 167 and 968–984 µs in one of 833; with
the order 6, 10 and 35 µs, most of the last the round's measuring of the pool, which
placing by key pays too (``bench/dispatch_round.py``).

**VIP reserve** (``RoundBudget``): in every dimension, non-VIP work must leave
``vip_reserve`` of the budget free; only VIP requests may use it. A VIP arriving in a
burst finds room on the engines at once instead of waiting for bulk work to finish.
Whatever its size, one request always fits a dimension that holds nothing (a prompt
larger than the prefill budget is not stuck forever).
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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

    __slots__ = ("in_pool", "index", "kv", "prefill", "slack", "taken", "view")

    def __init__(self, view: WorkerView, slack: int, index: int) -> None:
        self.view = view
        self.slack = slack
        self.index = index
        """Its place among the round's workers: ties go to the first."""
        self.taken = 0
        """Requests it took this round (what dates its entries in an ``_Order``)."""
        self.in_pool = view.in_pool
        self.kv = view.kv_in_pool
        self.prefill = view.prefill_in_pool

    @property
    def free(self) -> int:
        """Its slots left this round, the VIP reserve included."""
        return self.view.slots + self.slack - self.in_pool

    def fits(self, cost: Cost, keep: float) -> bool:
        v = self.view
        budgets = (v.slots, v.kv_budget, v.prefill_budget)
        return _fits(cost, keep, self.free, budgets, self.kv, self.prefill)

    @property
    def full(self) -> bool:
        """No slot left even for VIP: nothing fits it again this round."""
        return self.free < 1

    def take(self, cost: Cost) -> None:
        self.taken += 1
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
        top = total = self.in_pool / v.slots if v.slots else 1.0
        if v.kv_budget:
            share = self.kv / v.kv_budget
            top, total = max(top, share), total + share
        if v.prefill_budget:
            share = self.prefill / v.prefill_budget
            top, total = max(top, share), total + share
        return top + total / 1000  # ties go to the emptier overall


LOOKS = 8
"""Workers a placement looks at in order before it passes over the whole pool: when
the least loaded ones do not fit a request (VIP reserve reached, KV or prefill full)
while others do, the pass costs what placing cost before the order, and no more."""


def _short_key(room: _Room) -> tuple[int, float]:
    return room.prefill_steps, room.load


def _long_key(room: _Room) -> float:
    return room.load


class _Order:
    """A round's workers that have a slot left, by ``key``, least first, ties in their
    order: a heap of (key, index, ``taken`` when pushed). A room's entry goes stale when
    it takes a request (``renew`` pushes the new one, unless the room is full);
    stale entries are dropped as they surface. A full room leaves for the round: near
    saturation, full workers would otherwise be looked at for every request."""

    def __init__(self, rooms: Sequence[_Room], key: Callable[[_Room], object]) -> None:
        self._rooms = rooms
        self._key = key
        self._heap: list[tuple[Any, int, int]] = [
            (key(r), r.index, r.taken) for r in rooms if not r.full
        ]
        heapq.heapify(self._heap)

    def renew(self, room: _Room) -> None:
        if not room.full:
            heapq.heappush(self._heap, (self._key(room), room.index, room.taken))

    def least(self) -> _Room | None:
        """The least room with a slot left, if any."""
        heap = self._heap
        while heap:
            _, index, taken = heap[0]
            room = self._rooms[index]
            if taken == room.taken:
                return room
            heapq.heappop(heap)
        return None

    def first_fitting(self, cost: Cost, keep: float) -> _Room | None:
        """The least room ``cost`` fits, if one of the ``LOOKS`` least does."""
        heap = self._heap
        looked: list[tuple[Any, int, int]] = []
        found = None
        while heap and len(looked) < LOOKS:
            entry = heapq.heappop(heap)
            room = self._rooms[entry[1]]
            if entry[2] != room.taken:
                continue  # stale
            looked.append(entry)
            if room.fits(cost, keep):
                found = room
                break
        for entry in looked:
            heapq.heappush(heap, entry)
        return found


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
        self._rooms = [_Room(w, slack, i) for i, w in enumerate(w for w in workers if w.partitions)]
        self._owner = {p: room for room in self._rooms for p in room.view.partitions}
        self._partitions = sorted(self._owner)
        self._short: _Order | None = None
        self._long: _Order | None = None
        """The rooms in placement order, for short requests and for long prompts
        (``_order``): each built when the round first asks."""

    def _order(self, long: bool) -> _Order:
        if long:
            if self._long is None:
                self._long = _Order(self._rooms, _long_key)
            return self._long
        if self._short is None:
            self._short = _Order(self._rooms, _short_key)
        return self._short

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
        if not self._rooms:
            return True
        least = self._order(long=False).least()
        if least is None:
            return False  # every worker full
        return least.fits(cost, keep) or any(room.fits(cost, keep) for room in self._rooms)

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
            long = bool(self._long_prompt) and cost.prompt_tokens >= self._long_prompt
            room = self._order(long).first_fitting(cost, keep)
            if room is None:
                fitting = [r for r in self._rooms if r.fits(cost, keep)] or self._rooms
                room = min(fitting, key=_long_key if long else _short_key)
        room.take(cost)
        for built in (self._short, self._long):
            if built is not None:
                built.renew(room)
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
