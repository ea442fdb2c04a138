"""Hotspot detection: a client region whose arrivals surge past a multiple of its own
baseline while the fleet is hurting is throttled, and lifted with hysteresis. Pure: no
I/O, time is what the caller passes as ``now``.

Inputs: the arrivals every ingress counted per region (``record``), and at each
``evaluate`` whether the fleet is hurt (a pool's breaker acting or its ladder engaged).

Per region:

- *rate*: arrivals per second over the last ``window_s``;
- *baseline*: what the region usually sends — an exponentially weighted mean of its
  rate with time constant ``baseline_tau_s``, learned only while it neither surges nor
  is throttled (a surge must not become its own baseline) — unless the fleet took the
  surge unhurt for ``relax_hold_s``: then it is the region's new normal; nothing is
  judged before ``warmup_s`` of observation;
- *surging*: its rate above ``surge_factor`` × max(baseline, ``min_rate_per_s``).

A region is throttled once it has surged, with the fleet hurt, for ``hold_s``: its
throttle admits ``allow_factor`` × its baseline per second (at least ``min_rate_per_s``):
its usual traffic goes on, the surge waits in its clients' retries. It is lifted once,
for ``lift_hold_s``, its rate stayed below ``lift_factor`` × baseline (the surge is
over) — or once the fleet was not hurt for ``relax_hold_s`` (the fleet may take the
surge now; if it cannot, it is hurt again and the region is throttled after ``hold_s``).
Arrivals are counted at ingress, before any throttle, so a throttled region's rate
still shows its surge.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from services.controller.policy.decision import Decision, DecisionKind, Evidence
from services.controller.policy.hysteresis import HoldTimer


@dataclass(frozen=True)
class HotspotConfig:
    window_s: float = 30.0
    baseline_tau_s: float = 600.0
    warmup_s: float = 120.0
    surge_factor: float = 3.0
    min_rate_per_s: float = 1.0
    hold_s: float = 10.0
    allow_factor: float = 1.5
    lift_factor: float = 1.5
    lift_hold_s: float = 60.0
    relax_hold_s: float = 300.0
    max_regions: int = 256
    """Regions tracked at most (the wire bounds a report to as many)."""

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.baseline_tau_s <= 0:
            raise ValueError("window_s and baseline_tau_s must be > 0")
        if self.warmup_s < self.window_s:
            raise ValueError("warmup_s must cover at least one window")
        if not 1 < self.lift_factor < self.surge_factor:
            raise ValueError("need 1 < lift_factor < surge_factor (hysteresis)")
        if self.allow_factor < 1 or self.min_rate_per_s <= 0:
            raise ValueError("need allow_factor >= 1 and min_rate_per_s > 0")

    def scaled(self, k: float) -> HotspotConfig:
        """Every duration times ``k`` (tests and benchmarks run hours in seconds)."""
        return HotspotConfig(
            window_s=self.window_s * k,
            baseline_tau_s=self.baseline_tau_s * k,
            warmup_s=self.warmup_s * k,
            surge_factor=self.surge_factor,
            min_rate_per_s=self.min_rate_per_s,
            hold_s=self.hold_s * k,
            allow_factor=self.allow_factor,
            lift_factor=self.lift_factor,
            lift_hold_s=self.lift_hold_s * k,
            relax_hold_s=self.relax_hold_s * k,
            max_regions=self.max_regions,
        )


@dataclass(frozen=True)
class Throttle:
    """A region's state: ``rate_per_s`` is ``None`` while it is not throttled."""

    rate_per_s: float | None = None


class _Region:
    def __init__(self, now: float, config: HotspotConfig) -> None:
        self.first_seen = now
        self.counts: deque[tuple[float, int]] = deque()
        self.baseline: float | None = None
        self.learned_at = now
        self.throttle = Throttle()
        self.surge = HoldTimer(config.hold_s)
        self.calm = HoldTimer(config.lift_hold_s)
        self.absorbed = HoldTimer(config.relax_hold_s)
        """A surge the fleet took without being hurt, for how long."""


class HotspotDetector:
    def __init__(self, config: HotspotConfig | None = None) -> None:
        self.config = config or HotspotConfig()
        self._regions: dict[str, _Region] = {}
        self._calm_fleet = HoldTimer(self.config.relax_hold_s)

    def throttles(self) -> dict[str, float]:
        """The regions throttled now and their admitted rates."""
        return {
            name: r.throttle.rate_per_s
            for name, r in self._regions.items()
            if r.throttle.rate_per_s is not None
        }

    def record(self, now: float, arrivals: dict[str, int]) -> None:
        """Arrivals counted per region up to ``now`` (one ingress's report)."""
        for name, count in arrivals.items():
            region = self._regions.get(name)
            if region is None:
                if len(self._regions) >= self.config.max_regions:
                    continue  # bounded: a region past the bound is not watched
                region = self._regions[name] = _Region(now, self.config)
            region.counts.append((now, max(0, count)))

    def rate(self, name: str, now: float) -> float:
        region = self._regions.get(name)
        if region is None:
            return 0.0
        self._trim(region, now)
        observed = min(self.config.window_s, max(1e-9, now - region.first_seen))
        return sum(c for _, c in region.counts) / max(observed, 1.0)

    def baseline(self, name: str) -> float | None:
        region = self._regions.get(name)
        return None if region is None else region.baseline

    def evaluate(self, now: float, fleet_hurt: bool) -> list[Decision[Throttle]]:
        """Update every region; the throttles that start or end now, with evidence."""
        cfg = self.config
        fleet_calm = self._calm_fleet.observe(now, not fleet_hurt)
        decisions: list[Decision[Throttle]] = []
        for name, region in self._regions.items():
            rate = self.rate(name, now)
            floor = max(region.baseline or 0.0, cfg.min_rate_per_s)
            warm = now - region.first_seen >= cfg.warmup_s and region.baseline is not None
            surging = warm and rate > cfg.surge_factor * floor
            throttled = region.throttle.rate_per_s is not None
            absorbed = region.absorbed.observe(now, surging and not fleet_hurt)
            if not throttled and (not surging or absorbed):
                # A surge the fleet took in its stride for the whole relax hold is the
                # region's new normal; any other surge teaches its baseline nothing.
                self._learn(region, rate, now)
            if not throttled:
                if region.surge.observe(now, surging and fleet_hurt):
                    allowed = max(cfg.min_rate_per_s, cfg.allow_factor * floor)
                    reason = "arrivals surging while the fleet is hurt"
                    evidence = self._evidence(name, rate, region, fleet_hurt, reason, cfg.hold_s)
                    decisions.append(self._change(name, region, Throttle(allowed), now, evidence))
                continue
            if region.calm.observe(now, rate < cfg.lift_factor * floor):
                reason, hold_s = "the surge is over", cfg.lift_hold_s
            elif fleet_calm:
                reason, hold_s = "the fleet was not hurt for the relax hold", cfg.relax_hold_s
            else:
                continue
            evidence = self._evidence(name, rate, region, fleet_hurt, reason, hold_s)
            decisions.append(self._change(name, region, Throttle(), now, evidence))
        return decisions

    # -- internals -------------------------------------------------------------
    def _trim(self, region: _Region, now: float) -> None:
        horizon = now - self.config.window_s
        while region.counts and region.counts[0][0] <= horizon:
            region.counts.popleft()

    def _learn(self, region: _Region, rate: float, now: float) -> None:
        """Move the baseline toward ``rate`` by the time passed since it last learned;
        the first reading once a whole window was observed starts it."""
        if now - region.first_seen < self.config.window_s:
            region.learned_at = now
            return
        if region.baseline is None:
            region.baseline = rate
        else:
            weight = 1.0 - math.exp(-(now - region.learned_at) / self.config.baseline_tau_s)
            region.baseline += weight * (rate - region.baseline)
        region.learned_at = now

    def _change(
        self, name: str, region: _Region, new: Throttle, now: float, evidence: Evidence
    ) -> Decision[Throttle]:
        previous, region.throttle = region.throttle, new
        region.surge.reset()
        region.calm.reset()
        region.learned_at = now  # the time throttled taught the baseline nothing
        return Decision(f"region:{name}", DecisionKind.HOTSPOT, now, previous, new, evidence)

    def _evidence(
        self, name: str, rate: float, region: _Region, fleet_hurt: bool, reason: str, hold_s: float
    ) -> Evidence:
        cfg = self.config
        baseline = region.baseline or 0.0
        return Evidence(
            reason=f"region {name}: {reason}",
            window_s=cfg.window_s,
            metrics={
                "arrivals_per_s": rate,
                "baseline_per_s": baseline,
                "surge_ratio": rate / max(baseline, cfg.min_rate_per_s),
                "fleet_hurt": float(fleet_hurt),
            },
            thresholds={
                "surge_factor": cfg.surge_factor,
                "lift_factor": cfg.lift_factor,
                "allow_factor": cfg.allow_factor,
            },
            hold_s=hold_s,
        )
