"""``seawall events`` without a broker: which records it prints, and how."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from schemas import (
    BatchLimit,
    BreakerLevel,
    BreakerState,
    DegradationLevel,
    Evidence,
    QuotaOverride,
    RegionThrottle,
    TrafficSplit,
)
from seawall.events import KINDS, EventView, describe, run_events
from seawall_client.serde import encode
from services.common.settings import CommonSettings

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0
EVIDENCE = Evidence(
    reason="error_rate 0.5 > 0.3 over 300s",
    window_s=300.0,
    metrics={"error_rate": 0.5, "error_rate.samples": 40.0},
    thresholds={"error_rate": 0.3},
    hold_s=0.0,
    previous="closed",
)


def breaker(seq: int, state: str = "open", scope: str = "worker:w1", **kw: float) -> BreakerState:
    return BreakerState(
        scope=scope,
        seq=seq,
        issued_at=kw.get("issued_at", T0),
        valid_for_s=kw.get("valid_for_s", 60.0),
        evidence=EVIDENCE,
        state=state,
        level=BreakerLevel.LOG if state == "open" else BreakerLevel.NONE,
        tripped=("error_rate",) if state == "open" else (),
    )


def limit(seq: int, value: int) -> BatchLimit:
    return BatchLimit(
        scope="worker:w1",
        seq=seq,
        issued_at=T0,
        worker_id="w1",
        limit=value,
        evidence=Evidence(reason="latency"),
    )


def test_a_decision_is_printed_with_its_evidence() -> None:
    view = EventView()
    line = view.feed(encode(breaker(1)))
    assert line is not None
    text = render(line)
    assert "breaker/worker:w1 open level=LOG tripped=error_rate" in text
    assert "error_rate 0.5 > 0.3 over 300s" in text
    assert "error_rate=0.5" in text
    assert "thresholds error_rate=0.3" in text
    assert "was closed" in text


def test_republications_and_stale_duplicates_are_not_printed_again() -> None:
    view = EventView()
    assert view.feed(encode(breaker(10))) is not None
    assert view.feed(encode(breaker(11, valid_for_s=65.0))) is None  # re-published
    assert view.feed(encode(breaker(5, state="closed"))) is None  # stale (lower seq)
    assert view.feed(encode(breaker(12, state="closed", issued_at=T0 + 9))) is not None
    current = view.state.get(BreakerState, "worker:w1")
    assert current is not None
    assert current.seq == 12


def test_filters_by_scope_glob_and_kind() -> None:
    view = EventView(scope="worker:*", kind="batch_limit")
    assert view.feed(encode(breaker(1))) is None
    assert view.feed(encode(breaker(2, scope="pool:main"))) is None
    assert view.feed(encode(limit(3, 16))) is not None
    table = render(view.summary(T0))
    assert "batch_limit/worker:w1" in table
    assert "breaker/" not in table


def test_an_invalid_record_is_reported_and_skipped() -> None:
    view = EventView()
    line = view.feed(b"{not json")
    assert line is not None
    assert "invalid_json" in render(line)
    assert view.invalid == 1


def test_the_view_in_force_marks_expired_decisions() -> None:
    view = EventView()
    view.feed(encode(breaker(1)))
    assert "expired" not in render(view.summary(T0 + 10))
    assert "expired" in render(view.summary(T0 + 61))


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (breaker(1, state="closed"), "closed"),
        (
            DegradationLevel(
                scope="pool:main",
                seq=1,
                issued_at=T0,
                evidence=EVIDENCE,
                level=2,
                small_pool="small",
                max_tokens_cap=512,
            ),
            "level 2 small_pool=small max_tokens_cap=512",
        ),
        (limit(1, 8), "limit 8"),
        (
            TrafficSplit(
                scope="pool:main",
                seq=1,
                issued_at=T0,
                evidence=EVIDENCE,
                pool="main",
                weights={"v2": 0.05, "v1": 0.95},
            ),
            "pool main: v1=0.95 v2=0.05",
        ),
        (
            RegionThrottle(scope="region:eu", seq=1, issued_at=T0, evidence=EVIDENCE, region="eu"),
            "region eu: lifted",
        ),
        (
            QuotaOverride(
                scope="tenant:acme",
                seq=1,
                issued_at=T0,
                evidence=EVIDENCE,
                tenant="acme",
                requests_per_s=5.0,
            ),
            "tenant acme: requests/s 5, tokens/s -, burst -",
        ),
    ],
)
def test_every_kind_is_described(event: object, expected: str) -> None:
    assert describe(event) == expected  # type: ignore[arg-type]


def test_an_unknown_kind_is_refused_before_reaching_the_broker() -> None:
    out = io.StringIO()
    code = run_events(
        CommonSettings(kafka_bootstrap="127.0.0.1:1"), None, "nope", False, Console(file=out)
    )
    assert code == 2
    assert all(kind in out.getvalue() for kind in KINDS)


def render(markup: object) -> str:
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(markup)
    return out.getvalue()


def test_a_forged_event_is_shown_as_refused_and_never_as_a_decision() -> None:
    """With the followers' keys, ``seawall events`` shows what they would refuse as
    refused, and keeps it out of the decisions in force."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from services.common.control_signing import ControlSigner, ControlVerifier

    controller = ControlSigner("controller", Ed25519PrivateKey.generate())
    verifier = ControlVerifier({"controller": controller.key.public_key()})
    view = EventView(verifier=verifier)
    forged = encode(breaker(1, "open"))
    line = view.feed(forged, None)
    assert line is not None
    assert "refused" in line
    assert "unsigned" in line
    assert view.refused == 1
    assert view.state.get(BreakerState, "worker:w1") is None
    genuine = encode(breaker(2, "open"))
    assert view.feed(genuine, controller.headers(genuine)) is not None
    assert view.state.get(BreakerState, "worker:w1") is not None
    assert view.refused == 1
