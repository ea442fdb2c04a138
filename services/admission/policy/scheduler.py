"""The priority scheduler: which class (vip, standard, bulk) admission dispatches next.

Pure and deterministic: it sees only each class's backlog (and the age of its oldest
waiting request, measured by the caller's clock) and keeps two small counter sets.

Algorithm, per dispatch slot (``next``):

1. *Floors.* Every class with work accrues its ``min_share`` of the slot into a floor
   counter (a class without work has its counter reset: idleness earns nothing). If the
   largest counter has reached 1, that class is owed a slot and gets it. Any dispatch of
   a class pays 1 off its counter (clamped at 0). Because the shares sum to at most 1,
   the counters together stay below 3 between slots, so a counter of 2 or more would
   be the largest and be served: each counter stays below 2. Hence the guarantee:
   **in any window of N dispatches during which a class has work, it receives more
   than N × min_share − 2 of them** — VIP's floor (10% by default) and every other
   class's minimum share (no starvation). A class owed a slot whose oldest request does
   not fit what the pools hold now (``fits``) keeps its claim: nothing is dispatched
   until it fits (the round ends, capacity frees, a later round serves it). Before, a
   class whose head did not fit counted as idle and lost its counter, so a large
   standard or bulk request under sustained VIP load waited until it expired.
2. *Weights.* Otherwise the slot goes by smooth weighted round robin (nginx's SWRR)
   among the classes with work: each accrues ``weight / Σ weights`` into a credit, the
   largest credit wins and pays 1. Weights are dynamic: a class's base weight grows
   with the wait of its oldest request, ``1 + aging_per_s × wait``, up to
   ``max_age_boost`` times, so a backlog that has waited long is drained sooner.

VIP comes first: the largest base weight by default, and the winner of every tie. It
may take far more than its floor; the floors only cap how far the others can be pushed
back. The scheduler is work-conserving: a class with no work yields its share.

Mapping onto aiokafka (the shell, not this module): one consumer subscribes to the
three ``llm.requests.*`` topics. Each round the shell asks ``plan(loads, capacity)``
(capacity = what the pools can absorb now) and drains that many records per class
with ``getmany(*partitions_of_class, max_records=n)``; alternatively it keeps the
classes it does not want ``pause()``d and ``resume()``s the chosen ones. Pause state is
lost on a rebalance, so it is re-applied in the rebalance listener's
``on_partitions_assigned``. Records fetched but not yet dispatched are the backlog the
shell reports here, together with consumer lag if it likes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from schemas import Priority

ORDER: tuple[Priority, ...] = (Priority.VIP, Priority.STANDARD, Priority.BULK)
"""Priority order, also the tie-break order."""


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    min_share: float
    """Guaranteed fraction of dispatches while the class has work."""
    weight: float
    """Base weight for the slots the floors leave over."""


def _default_policies() -> dict[Priority, ClassPolicy]:
    return {
        Priority.VIP: ClassPolicy(min_share=0.10, weight=6.0),
        Priority.STANDARD: ClassPolicy(min_share=0.05, weight=3.0),
        Priority.BULK: ClassPolicy(min_share=0.05, weight=1.0),
    }


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policies: Mapping[Priority, ClassPolicy] = field(default_factory=_default_policies)
    aging_per_s: float = 0.1
    """Weight growth per second of the oldest request's wait."""
    max_age_boost: float = 4.0

    def __post_init__(self) -> None:
        if set(self.policies) != set(ORDER):
            raise ValueError("a policy is needed for each of vip, standard and bulk")
        shares = [p.min_share for p in self.policies.values()]
        if any(not 0.0 <= s <= 1.0 for s in shares) or sum(shares) > 1.0:
            raise ValueError("minimum shares must lie in [0, 1] and sum to at most 1")
        if any(not p.weight > 0.0 for p in self.policies.values()):
            raise ValueError("weights must be positive")
        if not self.aging_per_s >= 0.0 or not self.max_age_boost >= 1.0:
            raise ValueError("aging_per_s must be >= 0 and max_age_boost >= 1")


@dataclass(frozen=True, slots=True)
class ClassLoad:
    backlog: int
    """Requests of this class waiting to be dispatched."""
    oldest_wait_s: float = 0.0


class PriorityScheduler:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._floor = dict.fromkeys(ORDER, 0.0)
        self._credit = dict.fromkeys(ORDER, 0.0)

    def weight(self, cls: Priority, load: ClassLoad) -> float:
        """The dynamic weight: base weight boosted by the oldest request's wait."""
        boost = 1.0 + self.config.aging_per_s * max(0.0, load.oldest_wait_s)
        return self.config.policies[cls].weight * min(self.config.max_age_boost, boost)

    def next(
        self, loads: Mapping[Priority, ClassLoad], fits: Collection[Priority] | None = None
    ) -> Priority | None:
        """The class to dispatch from now; ``None`` when no class has work, or when the
        class owed a slot by its floor cannot be served now (``fits``: the classes whose
        oldest request fits what the pools hold now; ``None``: all of them). ``None``
        changes nothing: asked again, it answers the same until that request fits.

        Call once per dispatched request: the counters assume each answer is acted on.
        """
        working = [c for c in ORDER if c in loads and loads[c].backlog > 0]
        for c in ORDER:
            if c not in working:
                self._floor[c] = 0.0
                self._credit[c] = 0.0
        servable = [c for c in working if fits is None or c in fits]
        if not servable:
            return None
        floors = {c: self._floor[c] + self.config.policies[c].min_share for c in working}
        owed = max(working, key=floors.__getitem__)
        if floors[owed] >= 1.0 and owed not in servable:
            return None  # its claim holds: nothing else goes ahead of it
        self._floor.update(floors)
        chosen = owed if floors[owed] >= 1.0 else self._by_weight(servable, loads)
        self._floor[chosen] = max(0.0, self._floor[chosen] - 1.0)
        return chosen

    def _by_weight(self, servable: list[Priority], loads: Mapping[Priority, ClassLoad]) -> Priority:
        weights = {c: self.weight(c, loads[c]) for c in servable}
        total = sum(weights.values())
        # Keep the credits zero-sum over the classes served (classes come and go).
        mean = sum(self._credit[c] for c in servable) / len(servable)
        for c in servable:
            self._credit[c] += weights[c] / total - mean
        chosen = max(servable, key=self._credit.__getitem__)
        self._credit[chosen] -= 1.0
        return chosen

    def plan(self, loads: Mapping[Priority, ClassLoad], capacity: int) -> dict[Priority, int]:
        """How many requests of each class to dispatch into ``capacity`` free slots."""
        backlog = {c: loads[c].backlog for c in ORDER if c in loads}
        counts = dict.fromkeys(ORDER, 0)
        for _ in range(capacity):
            current = {c: ClassLoad(backlog[c], loads[c].oldest_wait_s) for c in backlog}
            chosen = self.next(current)
            if chosen is None:
                break
            backlog[chosen] -= 1
            counts[chosen] += 1
        return counts
