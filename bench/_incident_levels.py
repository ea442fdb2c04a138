"""The incident at several offered loads: the same scenario with the burst scaled to a
share of what the main pool can carry, run (a) uncontrolled and (b) with seawall.

A level's load is the burst's arrival rate over the main pool's saturation rate *for
the burst's own mix* (long prompts cost more): ``saturation`` queues 2,000 requests of
the mix at once on one simulated engine and counts what it finishes per second.

Per level, from the burst window (arrival in the burst), each figure as the issue asks:

- ``vip_p99_over_steady``: VIP P99 in the burst over VIP P99 in the steady window of the
  same run, for (a) and (b);
- ``goodput_ratio``: (b)'s goodput over (a)'s, goodput as DistServe counts it: answers
  within the SLO per second;
- ``smooth_goodput``: every *offered* request earns ``min(1, slo / latency)`` if answered
  (0 if refused, timed out or expired) — per second, for (a) and (b). Refusing work can
  only lower it, so a control plane cannot improve it by dropping load;
- ``slo_attainment``: per class, the share of offered requests answered within the SLO;
  ``vip_slo_attainment`` is VIP's, for (b);
- ``basic_jain_index``: Jain's index over the basic tenants of each tenant's SLO
  attainment, (Σx)² / (n Σx²): 1 when every basic tenant gets the same share.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from _common import ratio
from _incident_des import Outcome, run_uncontrolled
from _incident_peers import PEERS, refused_share, run_peer
from _incident_report import per_window
from _incident_scenario import CLASSES, Scenario, arrivals, sample
from _incident_seawall import Harness, SeawallRun

from schemas import Priority, Tier
from services.workers.engine.sim_config import SimConfig
from services.workers.engine.sim_core import SimCore
from services.workers.engine.sim_open_loop import run_open_loop


@dataclass(frozen=True, slots=True)
class Level:
    name: str
    load: float
    """The burst's arrival rate over the pool's saturation rate for the burst mix."""
    long_share: float | None = None
    """``None``: the scenario's."""


LEVELS: tuple[Level, ...] = (
    Level("half of capacity", 0.5),
    Level("seed burst (72% of capacity)", 0.72),
    Level("capacity", 1.0),
    Level("1.5x capacity", 1.5),
    Level("3x capacity", 3.0),
    Level("1.5x capacity, half long prompts", 1.5, long_share=0.5),
)


def saturation(config: SimConfig, requests: list[tuple[int, int]]) -> float:
    """Requests per second one engine sustains on this mix (all queued at once)."""
    records = run_open_loop(SimCore(config), [(0.0, p, o) for p, o in requests])
    finished = [r.finish_time for r in records if r.finish_time is not None]
    return len(finished) / max(finished)


def scenario_at(base: Scenario, level: Level) -> tuple[Scenario, float]:
    """The scenario whose burst offers ``level.load`` of the main pool's capacity for
    its mix, and that capacity (requests per second, whole pool)."""
    long_share = base.long_share if level.long_share is None else level.long_share
    per_gpu = saturation(base.engine(base.main_model), sample(base, long_share, 2_000))
    capacity = per_gpu * base.main_gpus
    factor = level.load * capacity / base.steady_rate
    return dataclasses.replace(base, burst_factor=factor, long_share=long_share), capacity


def smooth(outcomes: Sequence[Outcome], slo_s: float) -> float:
    return sum(
        min(1.0, slo_s / max(o.latency, 1e-9))
        for o in outcomes
        if o.answered and o.latency is not None
    )


def attainment(outcomes: Sequence[Outcome], slo_s: float) -> float | None:
    if not outcomes:
        return None
    good = sum(1 for o in outcomes if o.answered and o.latency is not None and o.latency <= slo_s)
    return good / len(outcomes)


def jain(values: Sequence[float]) -> float | None:
    square = sum(x * x for x in values)
    return sum(values) ** 2 / (len(values) * square) if square else None


def burst_figures(s: Scenario, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    lo, hi = s.windows()["burst"]
    inside = [o for o in outcomes if lo <= o.arrival.at < hi]
    by_class = {
        c.value: attainment([o for o in inside if o.arrival.priority is c], s.slo_s)
        for c in CLASSES
    }
    basic: defaultdict[str, list[Outcome]] = defaultdict(list)
    for o in inside:
        if o.arrival.tier is Tier.BASIC:
            basic[o.arrival.tenant].append(o)
    shares = [attainment(mine, s.slo_s) or 0.0 for mine in basic.values()]
    return {
        "smooth_goodput_per_s": smooth(inside, s.slo_s) / (hi - lo),
        "slo_attainment": by_class,
        "basic_jain_index": jain(shares),
    }


PEER_ARMS = ("vllm", "litellm", "gie")
NEAR_ZERO_GOODPUT_PER_S = 1.0
"""Below this, a peer's goodput is no denominator: its ratio is left out."""


FULL_ANSWERS: Final = ("none", "quota_degraded", "scavenged")
"""Reply reasons of a full answer from the requested model: a plain one, one a pro
tenant's burst level paid for (served at the class below its own), and one served from
idle capacity past a quota. The others are refusals, canned replies, or answers cut
short or from a smaller model."""


def is_good(o: Outcome, slo_s: float) -> bool:
    """A good answer: a full answer from the requested model, within the SLO."""
    return (
        o.kind in ("ok", "degraded")
        and o.reason in FULL_ANSWERS
        and o.latency is not None
        and o.latency <= slo_s
    )


def good_within_slo(outcomes: Sequence[Outcome], slo_s: float) -> int:
    return sum(1 for o in outcomes if is_good(o, slo_s))


def arm_figures(s: Scenario, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """One arm at one level: the burst window's goodput (good answers per second),
    degraded answers within the SLO apart, each class's share of good answers, the VIP
    P99 in the burst over its P99 in the same run's steady window, refusals."""
    windows = per_window(s, outcomes)
    lo, hi = s.windows()["burst"]
    inside = [o for o in outcomes if lo <= o.arrival.at < hi]
    vip = Priority.VIP.value
    attainment = {
        c.value: (
            good_within_slo(mine, s.slo_s) / len(mine)
            if (mine := [o for o in inside if o.arrival.priority is c])
            else None
        )
        for c in CLASSES
    }
    degraded = sum(
        1
        for o in inside
        if o.kind == "degraded"
        and o.reason not in FULL_ANSWERS
        and o.latency is not None
        and o.latency <= s.slo_s
    )
    good = good_within_slo(inside, s.slo_s)
    return {
        "goodput_per_s": good / (hi - lo),
        "degraded_within_slo_per_s": degraded / (hi - lo),
        "slo_attainment": attainment,
        "all_slo_attainment": good / len(inside) if inside else None,
        "vip_slo_attainment": attainment[vip],
        "vip_p99_s": windows["burst"][vip]["p99_s"],
        "vip_p99_steady_s": windows["steady"][vip]["p99_s"],
        "vip_p99_over_steady": ratio(
            windows["burst"][vip]["p99_s"], windows["steady"][vip]["p99_s"]
        ),
        "refused_share": refused_share(inside),
    }


def over_best_peer(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Seawall's goodput over the best peer's (vLLM, LiteLLM, the GIE; the uncontrolled
    arm is no peer), with both absolute figures; no ratio over a goodput under
    ``NEAR_ZERO_GOODPUT_PER_S``."""
    best = max(PEER_ARMS, key=lambda a: arms[a]["goodput_per_s"])
    peer = arms[best]["goodput_per_s"]
    mine = arms["seawall"]["goodput_per_s"]
    return {
        "best_peer": best,
        "best_peer_goodput_per_s": peer,
        "seawall_goodput_per_s": mine,
        "ratio": mine / peer if peer >= NEAR_ZERO_GOODPUT_PER_S else None,
    }


def run_level(base: Scenario, harness: Harness, level: Level) -> dict[str, Any]:
    s, capacity = scenario_at(base, level)
    traffic = arrivals(s)
    gpus = s.main_gpus + s.small_gpus  # every arm gets every GPU (_incident_peers)
    cores = [SimCore(s.engine(s.main_model), seed=i) for i in range(gpus)]
    uncontrolled = run_uncontrolled(traffic, cores, s.timeout_s)
    seawall, _ = SeawallRun(s, traffic, harness).run()
    lending = dataclasses.replace(harness, scavenger_tiers=frozenset({Tier.BASIC, Tier.PRO}))
    scavenger, _ = SeawallRun(s, traffic, lending).run()
    peers = {p.name: run_peer(s, traffic, p) for p in PEERS}
    arms = {
        name: arm_figures(s, outcomes)
        for name, outcomes in (
            ("uncontrolled", uncontrolled),
            *peers.items(),
            ("seawall", seawall),
            # Not a default: the same with work-conserving quotas for basic and pro
            # (SEAWALL_SCAVENGER_TIERS), for what lending idle capacity changes.
            ("seawall_scavenger", scavenger),
        )
    }
    a, b = per_window(s, uncontrolled), per_window(s, seawall)
    fa, fb = burst_figures(s, uncontrolled), burst_figures(s, seawall)
    vip = Priority.VIP.value
    best = over_best_peer(arms)
    return {
        "name": level.name,
        "arms": arms,
        "seawall_over_best_peer_goodput": best["ratio"],
        "best_peer": best,
        "offered_load_vs_capacity": level.load,
        "long_share": s.long_share,
        "burst_factor": s.burst_factor,
        "pool_capacity_req_per_s": capacity,
        "requests": len(traffic),
        "vip_p99_over_steady": {
            "uncontrolled": ratio(a["burst"][vip]["p99_s"], a["steady"][vip]["p99_s"]),
            "seawall": ratio(b["burst"][vip]["p99_s"], b["steady"][vip]["p99_s"]),
        },
        "vip_p99_s": {
            "uncontrolled": a["burst"][vip]["p99_s"],
            "seawall": b["burst"][vip]["p99_s"],
        },
        "goodput_per_s": {
            "uncontrolled": a["burst"]["all"]["goodput_per_s"],
            "seawall": b["burst"]["all"]["goodput_per_s"],
        },
        "goodput_ratio": ratio(
            b["burst"]["all"]["goodput_per_s"], a["burst"]["all"]["goodput_per_s"]
        ),
        "smooth_goodput_per_s": {
            "uncontrolled": fa["smooth_goodput_per_s"],
            "seawall": fb["smooth_goodput_per_s"],
        },
        "smooth_goodput_ratio": ratio(fb["smooth_goodput_per_s"], fa["smooth_goodput_per_s"]),
        "slo_attainment": {"uncontrolled": fa["slo_attainment"], "seawall": fb["slo_attainment"]},
        "vip_slo_attainment": fb["slo_attainment"][vip],
        "basic_jain_index": fb["basic_jain_index"],
        "basic_jain_index_uncontrolled": fa["basic_jain_index"],
        "not_answered_by_reason_seawall": {
            c: b["burst"][c]["not_answered_by_reason"] for c in (*(x.value for x in CLASSES),)
        },
    }
