"""A decision on the wire: a policy's evidence within the schema's bounds."""

from __future__ import annotations

import math

import pytest

from services.controller.decider.evidence import wire_evidence
from services.controller.policy import Evidence as PolicyEvidence

pytestmark = pytest.mark.unit


def test_wire_evidence_stays_within_the_schema_bounds() -> None:
    many = {f"m{i}": float(i) for i in range(40)}
    evidence = wire_evidence(
        PolicyEvidence(
            reason="x" * 600,
            window_s=1e9,
            metrics={**many, "bad": math.nan, "n" * 100: 1.0},
            thresholds={"t": math.inf, "ok": 2.0},
            hold_s=-5.0,
        ),
        previous="p" * 600,
    )
    assert len(evidence.reason) == 512
    assert len(evidence.previous or "") == 512
    assert evidence.window_s == 86_400.0
    assert evidence.hold_s == 0.0
    assert len(evidence.metrics) == 32
    assert "bad" not in evidence.metrics
    assert evidence.thresholds == {"ok": 2.0}
