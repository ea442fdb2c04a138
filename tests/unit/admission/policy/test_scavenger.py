"""Work-conserving quotas: the scavenger lane of a dispatch round (dispatching.py)."""

from __future__ import annotations

import itertools
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import BreakerLevel, BreakerState, DegradationLevel, Evidence, Priority
from seawall_client.clock import ManualClock
from services.admission.policy.bucket import DEFAULT_TIERS
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.config import PolicyConfig
from services.admission.policy.cost import Cost
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.policy.dispatching import SCAVENGER, Lane, Round, pick
from services.admission.policy.scheduler import PriorityScheduler
from services.admission.policy.workers import CapacityConfig
from services.common.control_state import ControlState
from tests.admission_helpers import Item

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0
WAIT_S = 2.0
VIP, STANDARD, BULK = Priority.VIP, Priority.STANDARD, Priority.BULK
SMALL = Cost(100, 50)
_seq = itertools.count(1)


Queues = dict[tuple[Lane, str], deque[Item]]


def queues(*content: tuple[Lane, int, float]) -> Queues:
    """(lane, how many, waiting since) on the main pool, named ``lane<i>``."""
    out: Queues = {}
    for lane, n, since in content:
        dq = out.setdefault((lane, "main"), deque())
        first = len(dq)
        name = lane if isinstance(lane, str) else lane.value
        dq.extend(Item(f"{name}{first + i}", since + i * 0.001, SMALL) for i in range(n))
    return out


def fleet(slots: int, in_flight: int = 0) -> FleetCapacity:
    cap = FleetCapacity(CapacityConfig(slack=0))
    cap.report("w1", "main", batch_limit=slots, in_flight=in_flight, now=0.0)
    return cap


def control(*events: BreakerState | DegradationLevel) -> ControlState:
    state = ControlState(ManualClock(NOW))
    for e in events:
        state.apply(e)
    return state


def common() -> dict[str, object]:
    return {
        "scope": "pool:main",
        "seq": next(_seq),
        "issued_at": NOW,
        "evidence": Evidence(reason="t"),
    }


def run(qs: Queues, cap: FleetCapacity, ctl: ControlState, now: float = 0.0) -> Round[Item]:
    policy = AdmissionPolicy(
        PolicyConfig(tiers=DEFAULT_TIERS, pools=("main", "small"), scavenger_wait_s=WAIT_S)
    )
    schedulers = {p: PriorityScheduler() for p in ("main", "small")}
    return pick(qs, ("main", "small"), policy, ctl, cap, schedulers, now)


def names(items: list[Item]) -> list[str]:
    return [i.name for i in items]


def test_idle_capacity_serves_over_quota_work_after_everyone_else() -> None:
    qs = queues((SCAVENGER, 5, -1.0), (BULK, 2, -0.5))
    got = run(qs, fleet(slots=4), control())
    assert names(got.picked) == ["bulk0", "bulk1", "scavenger0", "scavenger1"]
    assert got.shed == []
    assert len(qs[(SCAVENGER, "main")]) == 3  # they wait for the next room


def test_work_that_waits_for_the_pool_sheds_the_lane_at_once() -> None:
    qs = queues((SCAVENGER, 3, -1.0), (STANDARD, 6, -0.5))
    got = run(qs, fleet(slots=4), control())
    assert names(got.picked) == ["standard0", "standard1", "standard2", "standard3"]
    assert names(got.shed) == ["scavenger0", "scavenger1", "scavenger2"]


def test_over_quota_work_waits_at_most_scavenger_wait_s() -> None:
    qs = queues((SCAVENGER, 1, -WAIT_S - 0.5), (SCAVENGER, 1, -0.5))
    got = run(qs, fleet(slots=1, in_flight=1), control())  # a full pool
    assert names(got.shed) == ["scavenger0"]
    assert got.picked == []
    assert names(list(qs[(SCAVENGER, "main")])) == ["scavenger1"]


@pytest.mark.parametrize(
    "event",
    [
        BreakerState(**common(), state="open", level=BreakerLevel.RATE_LIMIT),  # type: ignore[arg-type]
        BreakerState(
            **common(), state="half_open", level=BreakerLevel.REJECT_NEW, probe_requests=3
        ),  # type: ignore[arg-type]
        BreakerState(**common(), state="open", level=BreakerLevel.REJECT_NEW),  # type: ignore[arg-type]
        DegradationLevel(**common(), level=1),  # type: ignore[arg-type]
    ],
    ids=["rate-limited", "half-open", "refusing", "degraded"],
)
def test_a_paced_or_degraded_pool_sheds_the_lane(event: BreakerState | DegradationLevel) -> None:
    qs = queues((SCAVENGER, 2, -0.5))
    got = run(qs, fleet(slots=64), control(event))
    assert names(got.shed) == ["scavenger0", "scavenger1"]
    assert got.picked == []


@settings(max_examples=200, deadline=None)
@given(
    lanes=st.lists(
        st.tuples(
            st.sampled_from([VIP, STANDARD, BULK, SCAVENGER]),
            st.integers(1, 8),
            st.floats(-5, 0, allow_nan=False),
        ),
        max_size=6,
    ),
    slots=st.integers(1, 20),
)
def test_the_lane_never_takes_what_a_class_could_use_and_loses_nothing(
    lanes: list[tuple[Lane, int, float]], slots: int
) -> None:
    qs = queues(*lanes)
    before = {i.name for dq in qs.values() for i in dq}
    got = run(qs, fleet(slots), control())
    after = {i.name for dq in qs.values() for i in dq}
    assert {*names(got.picked), *names(got.shed)} | after == before
    assert len(got.picked) + len(got.shed) + len(after) == len(before)
    scavenged = [n for n in names(got.picked) if n.startswith(SCAVENGER)]
    normal_left = [n for n in after if not n.startswith(SCAVENGER)]
    assert not (scavenged and normal_left)  # served only when no class waits
    if normal_left:
        assert not any(n.startswith(SCAVENGER) for n in after)  # and shed at once then
    assert all(n.startswith(SCAVENGER) for n in names(got.shed))
    assert len(got.picked) <= slots


def test_the_lane_leaves_headroom_for_the_work_that_may_come_next() -> None:
    qs = queues((SCAVENGER, 20, -0.5))
    got = run(qs, fleet(slots=10), control())
    assert len(got.picked) == 8  # scavenger_headroom 0.2 of 10 slots stays free
    # ... which prioritised work may still use.
    qs = queues((BULK, 5, -0.1))
    cap = fleet(slots=10, in_flight=8)
    assert len(run(qs, cap, control()).picked) == 2
