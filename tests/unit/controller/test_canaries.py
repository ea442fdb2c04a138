"""The controller's canary shell (``canaries``) without a broker: a command starts a
release, the pool's next owner resumes it from the last split, a command for a pool
this instance does not own is left to its owner."""

from __future__ import annotations

from schemas import CanaryRelease, Evidence, TrafficSplit
from seawall_client.clock import ManualClock
from services.common.control_state import ControlState
from services.controller.canaries import CanaryReleases, reference_of, weights

NOW = 1_000_000.0


def start(seq: int = 1) -> CanaryRelease:
    return CanaryRelease(
        scope="pool:main",
        seq=seq,
        issued_at=NOW,
        valid_for_s=86_400,
        issuer="operator:me",
        evidence=Evidence(reason="go"),
        pool="main",
        version="v2",
        action="start",
        release=seq,
        steps=(0.1, 1.0),
        check_s=5,
    )


def shell() -> CanaryReleases:
    return CanaryReleases(valid_for_s=60, republish_s=5, check_timeout_s=30)


def state(*events: CanaryRelease | TrafficSplit) -> ControlState:
    s = ControlState(ManualClock(NOW))
    for e in events:
        s.apply(e)
    return s


def test_weights_never_hold_a_zero_share() -> None:
    assert weights("main", "v2", 0.0) == {"main": 1.0}
    assert weights("main", "v2", 0.25) == {"main": 0.75, "main.canary-v2": 0.25}
    assert weights("main", "v2", 1.0) == {"main.canary-v2": 1.0}


def test_a_command_starts_a_release_and_an_idle_one_is_republished() -> None:
    canaries = shell()
    (first,) = canaries.evaluate(state(start()), {}, lambda pool: True, NOW)
    assert (first.phase, first.version, first.release) == ("checking", "v2", 1)
    assert first.weights == {"main": 1.0}
    assert canaries.evaluate(state(start()), {}, lambda pool: True, NOW + 1) == []
    (again,) = canaries.evaluate(state(start()), {}, lambda pool: True, NOW + 5)
    assert (again.seq > first.seq, again.issued_at, again.phase) == (True, NOW, "checking")


def test_the_next_owner_resumes_from_the_last_split() -> None:
    (first,) = shell().evaluate(state(start()), {}, lambda pool: True, NOW)
    ramping = first.model_copy(
        update={
            "seq": first.seq + 1,
            "phase": "ramping",
            "since": NOW + 6,
            "weights": weights("main", "v2", 0.1),
            "evidence": Evidence(
                reason="check passed",
                metrics={"baseline_requests": 100, "baseline_error_rate": 0.01},
            ),
        }
    )
    canaries = shell()
    # resumed at its step (a fresh start would publish "checking" first); no worker
    # reports for either arm here, so it rolls back at once
    (split,) = canaries.evaluate(state(start(), ramping), {}, lambda pool: True, NOW + 7)
    assert split.phase == "rolled_back"
    assert split.evidence.previous == "ramping step 1/2 at 10%"
    assert "gone" in split.evidence.reason
    reference = reference_of(ramping.evidence)
    assert reference is not None
    assert (reference.requests, reference.errors) == (100, 1)


def test_a_pool_owned_elsewhere_is_left_to_its_owner() -> None:
    canaries = shell()
    assert canaries.evaluate(state(start()), {}, lambda pool: False, NOW) == []
    assert canaries.runs == {}
    assert canaries.conditions() == []
