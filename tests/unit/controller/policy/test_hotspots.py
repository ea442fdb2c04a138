"""Hotspot detection: a surging region is throttled only while the fleet is hurt, at
its usual rate, and lifted with hysteresis."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.policy.decision import Decision, DecisionKind
from services.controller.policy.hotspots import HotspotConfig, HotspotDetector, Throttle

pytestmark = pytest.mark.unit

CFG = HotspotConfig()


class Sim:
    """One report a second from every region; an evaluation after each."""

    def __init__(self, config: HotspotConfig = CFG) -> None:
        self.detector = HotspotDetector(config)
        self.now = 0.0
        self.decisions: list[Decision[Throttle]] = []

    def run(self, seconds: int, rates: dict[str, int], hurt: bool = False) -> None:
        for _ in range(seconds):
            self.now += 1.0
            self.detector.record(self.now, rates)
            self.decisions += self.detector.evaluate(self.now, hurt)


def test_steady_traffic_is_never_throttled_even_when_the_fleet_is_hurt() -> None:
    sim = Sim()
    sim.run(600, {"eu": 20, "us": 50}, hurt=True)
    assert sim.decisions == []
    assert sim.detector.baseline("eu") == pytest.approx(20, rel=0.01)


def test_a_surge_while_the_fleet_is_hurt_is_throttled_to_its_usual_rate() -> None:
    sim = Sim()
    sim.run(300, {"eu": 20, "us": 50})
    sim.run(40, {"eu": 200, "us": 50}, hurt=True)
    (throttle,) = sim.decisions
    assert throttle.scope == "region:eu"
    assert throttle.kind is DecisionKind.HOTSPOT
    assert throttle.new_state.rate_per_s == pytest.approx(1.5 * 20, rel=0.02)
    assert throttle.previous_state == Throttle()
    metrics = throttle.evidence.metrics
    assert metrics["baseline_per_s"] == pytest.approx(20, rel=0.02)
    assert metrics["surge_ratio"] > 3
    assert metrics["fleet_hurt"] == 1.0
    assert throttle.evidence.hold_s == CFG.hold_s
    assert sim.detector.throttles() == {"eu": throttle.new_state.rate_per_s}
    # the surge took the hold (10 s) plus the time the window needed to show 3x
    assert 300 + 10 < throttle.at < 300 + 40


def test_a_surge_the_fleet_takes_is_not_throttled() -> None:
    sim = Sim()
    sim.run(300, {"eu": 20})
    sim.run(200, {"eu": 200})
    assert sim.decisions == []
    # ... and the surge did not become the baseline while it lasted (shorter than the
    # relax hold): a fleet hurt now still sees it as a surge
    assert sim.detector.baseline("eu") == pytest.approx(20, rel=0.05)
    sim.run(40, {"eu": 200}, hurt=True)
    assert [d.new_state.rate_per_s is not None for d in sim.decisions] == [True]


def test_a_lasting_shift_the_fleet_takes_becomes_the_baseline() -> None:
    sim = Sim()
    sim.run(300, {"eu": 20})
    sim.run(1800, {"eu": 100})  # half an hour, the fleet fine: the new normal
    assert sim.detector.baseline("eu") == pytest.approx(100, rel=0.1)
    sim.run(60, {"eu": 100}, hurt=True)
    assert sim.decisions == []


def test_the_throttle_lifts_once_the_surge_is_over() -> None:
    sim = Sim()
    sim.run(300, {"eu": 20})
    sim.run(60, {"eu": 200}, hurt=True)
    sim.run(80, {"eu": 20}, hurt=True)  # under 1.5x the baseline after 29 s, then 60 s
    assert len(sim.decisions) == 1
    sim.run(20, {"eu": 20}, hurt=True)
    throttle, lift = sim.decisions
    assert lift.new_state == Throttle()
    assert lift.previous_state == throttle.new_state
    assert lift.evidence.reason == "region eu: the surge is over"


def test_the_throttle_lifts_when_the_fleet_recovered_and_returns_if_it_hurts_again() -> None:
    sim = Sim()
    sim.run(300, {"eu": 20})
    sim.run(30, {"eu": 200}, hurt=True)
    sim.run(301, {"eu": 200})  # the throttle works: the fleet is fine for the relax hold
    throttle, lift = sim.decisions
    assert lift.evidence.reason == "region eu: the fleet was not hurt for the relax hold"
    sim.run(30, {"eu": 200}, hurt=True)  # the surge hurts it again
    assert [d.new_state.rate_per_s is not None for d in sim.decisions] == [True, False, True]
    assert sim.decisions[-1].new_state == throttle.new_state


def test_nothing_is_judged_before_the_warmup_and_regions_are_bounded() -> None:
    sim = Sim(HotspotConfig(max_regions=2))
    sim.run(100, {"eu": 500, "us": 1, "ap": 1}, hurt=True)
    assert sim.decisions == []
    assert sim.detector.baseline("ap") is None  # the third region is not tracked
    assert sim.detector.rate("ap", sim.now) == 0.0


def test_config_bounds() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        HotspotConfig(lift_factor=3.0, surge_factor=3.0)
    with pytest.raises(ValueError, match="window"):
        HotspotConfig(warmup_s=10, window_s=30)
    assert CFG.scaled(0.1).hold_s == pytest.approx(1.0)


phases = st.lists(
    st.tuples(st.integers(1, 120), st.integers(0, 400), st.integers(0, 60), st.booleans()),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(phases)
def test_throttles_follow_the_rules_under_any_traffic(
    plan: list[tuple[int, int, int, bool]],
) -> None:
    sim = Sim(HotspotConfig(window_s=10, warmup_s=30, hold_s=3, lift_hold_s=10, relax_hold_s=40))
    hurt_at: dict[float, bool] = {}
    for seconds, eu, us, hurt in [(60, 20, 20, False), *plan]:
        start = len(sim.decisions)
        for _ in range(seconds):
            sim.run(1, {"eu": eu, "us": us}, hurt)
            hurt_at[sim.now] = hurt
        for d in sim.decisions[start:]:
            if d.new_state.rate_per_s is not None:
                assert hurt_at[d.at]  # only ever throttled while the fleet is hurt
                assert d.new_state.rate_per_s >= sim.detector.config.min_rate_per_s
    for region in ("region:eu", "region:us"):
        mine = [d for d in sim.decisions if d.scope == region]
        for before, after in itertools.pairwise(mine):
            assert before.new_state == after.previous_state  # a chain of changes
            assert (before.new_state.rate_per_s is None) != (after.new_state.rate_per_s is None)
        assert all(d.at >= 30 for d in mine)  # nothing before the warmup
