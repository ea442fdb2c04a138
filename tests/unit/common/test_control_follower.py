"""What the control follower reports when a decision runs out: counted by kind, logged
at warning when the controller's (it has stopped re-publishing), at info when an
operator's (its time was up)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from schemas import BatchLimit, Evidence
from services.common.control import report_expired

pytestmark = pytest.mark.unit


def expired_count(kind: str) -> float:
    return REGISTRY.get_sample_value("seawall_control_expired_total", {"kind": kind}) or 0.0


def limit(issuer: str) -> BatchLimit:
    return BatchLimit(
        scope="worker:w1",
        seq=3,
        issued_at=1_000.0,
        valid_for_s=10,
        worker_id="w1",
        limit=8,
        issuer=issuer,
        evidence=Evidence(reason="test"),
    )


@pytest.mark.parametrize(
    ("issuer", "level"), [("controller", logging.WARNING), ("operator:ana", logging.INFO)]
)
def test_an_expired_decision_is_counted_and_logged_by_who_issued_it(
    issuer: str, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    before = expired_count("batch_limit")
    with caplog.at_level(logging.INFO, logger="services.common.control"):
        report_expired(limit(issuer))
    assert expired_count("batch_limit") == before + 1
    [entry] = caplog.records
    assert entry.levelno == level
    assert entry.key == "batch_limit/worker:w1"
    assert entry.seq == 3
