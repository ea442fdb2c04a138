"""A decision on the wire: a policy's evidence within the schema's bounds, a decision in
force published again, and the one-line descriptions of a state that an event's
evidence names as ``previous``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypeVar, cast

from schemas import ControlEvent, Evidence
from services.controller.policy import (
    BreakerStatus,
    Circuit,
    Decision,
    DegradationStatus,
)
from services.controller.policy import Evidence as PolicyEvidence

MAX_SECONDS = 86_400.0
"""The wire's bound on a duration (``schemas.base.Seconds``)."""
MAX_EVIDENCE_ENTRIES = 32
MAX_METRIC_NAME = 64

E = TypeVar("E", bound=ControlEvent)


def _finite(values: Mapping[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in values.items():
        if len(out) == MAX_EVIDENCE_ENTRIES:
            break
        if math.isfinite(value):
            out[name[:MAX_METRIC_NAME]] = value
    return out


def _seconds(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return min(MAX_SECONDS, max(0.0, value))


def wire_evidence(evidence: PolicyEvidence, previous: str | None) -> Evidence:
    """The policy's evidence within the wire's bounds (text lengths, entry counts,
    finite numbers, durations of at most a day)."""
    return Evidence(
        reason=evidence.reason[:512],
        window_s=_seconds(evidence.window_s) or 0.0,
        metrics=_finite(evidence.metrics),
        thresholds=_finite(evidence.thresholds),
        hold_s=_seconds(evidence.hold_s),
        previous=None if previous is None else previous[:512],
    )


def latched(decision: Decision[bool] | None, current: Evidence | None) -> Evidence | None:
    """A share alert's evidence while it is on, after its latest evaluation."""
    if decision is None:
        return current
    return wire_evidence(decision.evidence, "off") if decision.new_state else None


def republished(event: E, now: float, seq: int, valid_for_s: float) -> E:
    """A decision still in force, published again: valid ``valid_for_s`` from now, with
    its ``issued_at`` kept (readers see since when it holds) until that would take
    ``valid_for_s`` past the wire's bound (a day), when it is issued afresh."""
    age = max(0.0, now - event.issued_at)
    update: dict[str, float | int] = {"seq": seq}
    if age + valid_for_s <= MAX_SECONDS:
        update["valid_for_s"] = age + valid_for_s
    else:
        update.update(issued_at=now, valid_for_s=valid_for_s)
    return cast(E, event.model_copy(update=update))


def describe_breaker(status: BreakerStatus) -> str:
    if status.circuit is Circuit.CLOSED:
        return "closed"
    causes = ",".join(status.tripped) or "-"
    return f"{status.circuit.value} level={status.level.name} tripped={causes}"


def describe_degradation(status: DegradationStatus) -> str:
    return f"level {status.level} ({','.join(status.triggered) or 'none triggered'})"
