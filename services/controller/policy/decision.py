"""What every policy core returns: a decision with the evidence that caused it.

Policies emit a ``Decision`` only when their state changes; the controller's shell turns
it into a ``ControlEvent`` (``schemas.control``) and re-publishes the state in force on
its own schedule. ``Evidence`` mirrors the wire's ``schemas.control.Evidence`` field for
field (less ``previous``, which is the decision's ``previous_state``), so the shell maps
it without interpretation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Generic, TypeVar

S = TypeVar("S")


class DecisionKind(StrEnum):
    BREAKER = "breaker"
    HEARTBEAT = "heartbeat"
    DEGRADATION = "degradation"
    BATCH_LIMIT = "batch_limit"
    LONG_PROMPT_ALERT = "long_prompt_alert"
    OUTPUT_CONSISTENCY_ALERT = "output_consistency_alert"
    HOTSPOT = "hotspot"
    CANARY = "canary"


@dataclass(frozen=True)
class Reading:
    """One metric as a window reports it: its value and how many samples it rests on;
    for a proportion, ``low``: the lower bound of what it may truly be on so few
    samples (``windows.wilson_lower``), which is what must pass a trip threshold."""

    value: float
    samples: int
    low: float | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.value):
            raise ValueError(f"reading must be finite, got {self.value}")
        if self.samples < 0:
            raise ValueError(f"samples must be >= 0, got {self.samples}")


@dataclass(frozen=True)
class Evidence:
    """The numbers behind a decision.

    ``metrics`` and ``thresholds`` share keys where a value was compared with a limit;
    ``hold_s`` is how long the deciding condition held (0 when it acts at once).
    """

    reason: str
    window_s: float = 0.0
    metrics: Mapping[str, float] = field(default_factory=dict)
    thresholds: Mapping[str, float] = field(default_factory=dict)
    hold_s: float | None = None

    def __post_init__(self) -> None:
        # Frozen all the way down (a decision must not change after it was made), plain
        # str keys and float values (what the wire's Evidence carries).
        for name in ("metrics", "thresholds"):
            numbers = {str(k): float(v) for k, v in getattr(self, name).items()}
            object.__setattr__(self, name, MappingProxyType(numbers))

    @staticmethod
    def combine(parts: Sequence[Evidence]) -> Evidence:
        """One evidence for several causes found in the same evaluation: reasons joined,
        numbers merged, the widest window and the longest hold kept."""
        if not parts:
            raise ValueError("no evidence to combine")
        if len(parts) == 1:
            return parts[0]
        holds = [p.hold_s for p in parts if p.hold_s is not None]
        return Evidence(
            reason="; ".join(p.reason for p in parts),
            window_s=max(p.window_s for p in parts),
            metrics={k: v for p in parts for k, v in p.metrics.items()},
            thresholds={k: v for p in parts for k, v in p.thresholds.items()},
            hold_s=max(holds) if holds else None,
        )


@dataclass(frozen=True)
class Decision(Generic[S]):
    """A change of a policy's state for one scope (``worker:<id>``, ``pool:<name>``, ...),
    made at ``at`` (the injected clock's seconds)."""

    scope: str
    kind: DecisionKind
    at: float
    previous_state: S
    new_state: S
    evidence: Evidence
