"""The seed incident, and what seawall's control plane does about it.

A customer-service fleet serves its steady traffic at a P99 of about 1.2 s; then a
sales event: five times the arrivals for a while, 30% of them with long prompts, from
tenants of all three tiers. The same arrivals (same seed) run twice, in one process:

- (a) no control plane: every request goes straight to the least-loaded engine of the
  main pool, which runs up to ``max_num_seqs`` and queues the rest (vLLM's own queue);
  a client that times out disconnects and its request is aborted;
- (b) seawall with every defence on: tenant quotas, the VIP-floor priority scheduler,
  dispatch paced per worker in the engines' units and placed by admission, the
  engines' priority policy, the breaker matrix, the degradation
  ladder (small pool, truncation, canned replies), the adaptive batch limit, deadlines.

Both run on virtual time (``_incident_des``): the engines are the calibrated simulator
(``services/workers/engine/sim_*.py``, vLLM V1's scheduler and step times) stepped
in a discrete-event loop, so the run is deterministic and needs one core. In (b) the
real policy cores of admission, the workers and the controller are composed as their
service shells compose them (``_incident_seawall``); Kafka hops are fixed delays and
Redis is the bucket model the Lua script runs. The end-to-end path through the broker
and Redis is what ``reaction.py`` and the other benchmarks measure. Policy windows and
holds are scaled by ``--time-scale`` (the controller's ``SEAWALL_CONTROLLER_TIME_SCALE``)
so that minutes of policy fit the burst; thresholds are not scaled.

Usage: ``python bench/incident.py [--quick] [--seed 1] [--time-scale 0.05]``.
Writes ``bench/results/incident.json`` and ``.png`` (``--quick``: a shorter run, written
to a temporary directory); prints per priority class the (b)/(a) ratios, and each run's
burst P99 against its own steady P99 measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import time
from pathlib import Path
from typing import Any

from _common import commit, fmt, output_dir, ratio
from _incident_des import run_uncontrolled
from _incident_levels import LEVELS, run_level, saturation
from _incident_report import control_summary, per_window, plot, ratios
from _incident_scenario import CLASSES, Scenario, arrivals, sample, tier_configs
from _incident_seawall import Harness, SeawallRun

from services.workers.engine.sim_core import SimCore


def load(s: Scenario) -> dict[str, float]:
    config = s.engine(s.main_model)
    steady = saturation(config, sample(s, 0.0, 2_000))
    burst = saturation(config, sample(s, s.long_share, 2_000))
    per_gpu = s.steady_rate / s.main_gpus
    return {
        "saturation_per_gpu_steady_mix": steady,
        "saturation_per_gpu_burst_mix": burst,
        "steady_share_of_saturation": per_gpu / steady,
        "burst_share_of_saturation": per_gpu * s.burst_factor / burst,
    }


def uncontrolled_growth(s: Scenario) -> dict[str, Any]:
    """(a) alone on other seeds and at ±10% of the steady rate: how far the burst lifts
    the P99 (all classes) over the steady P99, to show the shape is not a knife edge."""
    rows = []
    variants = [(seed, 1.0) for seed in range(s.seed, s.seed + 5)]
    variants += [(s.seed, 0.9), (s.seed, 1.1)]
    for seed, k in variants:
        v = dataclasses.replace(s, seed=seed, steady_rate=s.steady_rate * k)
        gpus = v.main_gpus + v.small_gpus
        cores = [SimCore(v.engine(v.main_model), seed=i) for i in range(gpus)]
        r = per_window(v, run_uncontrolled(arrivals(v), cores, v.timeout_s))
        steady, burst = r["steady"]["all"]["p99_s"], r["burst"]["all"]["p99_s"]
        rows.append(
            {
                "seed": seed,
                "steady_rate": v.steady_rate,
                "steady_p99_s": steady,
                "burst_p99_s": burst,
                "burst_over_steady": ratio(burst, steady),
            }
        )
    return {"runs": rows}


def policy_windows(h: Harness) -> dict[str, Any]:
    c = h.controller_settings().decider_config()
    rows = {
        "breaker.latency_p99_ms": c.breaker.latency_p99_ms,
        "breaker.error_rate": c.breaker.error_rate,
        "ladder.latency_p99_ms (rung 1)": c.degradation.latency_p99_ms,
        "ladder.error_rate (rung 2)": c.degradation.error_rate,
        "ladder.gpu_temperature_c (rung 3)": c.degradation.gpu_temperature_c,
    }
    out: dict[str, Any] = {k: dataclasses.asdict(t) for k, t in rows.items()}
    out["batch.min_interval_s"] = c.batch.min_interval_s
    out["batch.sla_ms"] = c.batch.sla_ms
    out["breaker.probe_retry_s"] = c.breaker.probe_retry_s
    return out


def print_table(s: Scenario, a: dict[str, Any], b: dict[str, Any], window: str) -> None:
    lo, hi = s.windows()[window]
    print(f"\n{window} window, arrivals in [{lo:g}, {hi:g}) s")
    head = f"{'p50 s':>7}{'p99 s':>7}{'success':>9}{'good/s':>8}"
    print(f"{'class':<9}{'n':>6}  (a) {head}  (b) {head}   (b)/(a): {'p99':>6}{'good/s':>8}")
    for c in (*(c.value for c in CLASSES), "all"):
        ra, rb = a[window][c], b[window][c]
        cells = []
        for r in (ra, rb):
            cells.append(
                f"{fmt(r['p50_s'], '.2f'):>7}{fmt(r['p99_s'], '.2f'):>7}"
                f"{fmt(100 * r['success_rate'], '.1f') + '%':>9}{r['goodput_per_s']:>8.1f}"
            )
        p99 = fmt(ratio(rb["p99_s"], ra["p99_s"]), ".2f")
        good = fmt(ratio(rb["goodput_per_s"], ra["goodput_per_s"]), ".2f")
        gap = " " * 6
        print(f"{c:<9}{ra['requests']:>6}{gap}{cells[0]}{gap}{cells[1]}{gap * 2}{p99:>6}{good:>8}")


def growth(result: dict[str, Any], steady: dict[str, Any]) -> dict[str, float | None]:
    """Burst P99 over the steady P99 of a baseline, per class."""
    return {c: ratio(result["burst"][c]["p99_s"], steady[c]["p99_s"]) for c in result["burst"]}


def percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def print_levels(levels: list[dict[str, Any]]) -> None:
    print("\noffered load levels, burst window, every arm on the same GPUs and arrivals:")
    print(
        f"{'level':<34}{'arm':<14}{'goodput/s':>10}{'degraded/s':>11}{'SLO all':>9}"
        f"{'SLO VIP':>9}{'VIP p99/steady':>16}{'refused':>9}"
    )
    for lv in levels:
        for i, (arm, f) in enumerate(lv["arms"].items()):
            name = lv["name"] if i == 0 else ""
            print(
                f"{name:<34}{arm:<14}{f['goodput_per_s']:>10.1f}"
                f"{f['degraded_within_slo_per_s']:>11.1f}"
                f"{fmt(percent(f['all_slo_attainment']), '.1f'):>8}%"
                f"{fmt(percent(f['vip_slo_attainment']), '.1f'):>8}%"
                f"{fmt(f['vip_p99_over_steady'], '.2f'):>15}x"
                f"{fmt(percent(f['refused_share']), '.1f'):>8}%"
            )
        b = lv["best_peer"]
        print(
            f"{'':<34}seawall {b['seawall_goodput_per_s']:.1f}/s against the best peer"
            f" ({b['best_peer']}) {b['best_peer_goodput_per_s']:.1f}/s:"
            f" {fmt(b['ratio'], '.2f')}x"
        )


def highest_sustained(levels: list[dict[str, Any]], share: float = 0.9) -> dict[str, Any]:
    """Per arm, the highest offered load among the levels of the scenario's own mix at
    which ``share`` of the burst's requests got a full answer within the SLO (``None``:
    not even the lowest). On the levels' grid only: the load itself lies between that
    level and the next."""
    mix = [lv for lv in levels if lv["long_share"] == levels[0]["long_share"]]
    out: dict[str, Any] = {"grid": [lv["offered_load_vs_capacity"] for lv in mix]}
    for arm in levels[0]["arms"]:
        ok = [
            lv["offered_load_vs_capacity"]
            for lv in mix
            if (lv["arms"][arm]["all_slo_attainment"] or 0.0) >= share
        ]
        out[arm] = max(ok) if ok else None
    return out


def plot_levels(levels: list[dict[str, Any]], path: Path, slo_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [lv["name"] for lv in levels]
    x = range(len(levels))
    arms = list(levels[0]["arms"])
    width = 0.8 / len(arms)
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.8))
    for k, arm in enumerate(arms):
        offset = (k - (len(arms) - 1) / 2) * width
        left.bar(
            [i + offset for i in x],
            [lv["arms"][arm]["vip_p99_over_steady"] or 0 for lv in levels],
            width=width,
            label=arm,
        )
        right.bar(
            [i + offset for i in x],
            [lv["arms"][arm]["goodput_per_s"] for lv in levels],
            width=width,
            label=arm,
        )
    left.axhline(1.2, color="black", linestyle="--", linewidth=1, label="goal 1.2x")
    left.set_ylabel("VIP P99 in the burst / VIP P99 steady")
    right.set_ylabel(f"goodput: full answers within {slo_s:g} s per second")
    for ax in (left, right):
        ax.set_xticks(list(x), names, rotation=15, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle("Seed incident at several offered loads (virtual time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (about a third)")
    parser.add_argument("--seed", type=int, default=Scenario.seed)
    parser.add_argument("--time-scale", type=float, default=Harness.time_scale)
    parser.add_argument("--tick", type=float, default=Harness.tick_s, help="controller tick, s")
    parser.add_argument("--bus-delay", type=float, default=Harness.bus_delay_s, help="per hop, s")
    parser.add_argument(
        "--latency-recover-ms",
        type=float,
        default=Harness.latency_recover_ms,
        help="the breaker's latency recovery threshold (DESIGN: 800; this fleet runs at 1.2 s)",
    )
    parser.add_argument(
        "--quota-headroom",
        type=float,
        default=Scenario.quota_headroom,
        help="tenant quotas as a multiple of their steady use (enterprise: of their peak)",
    )
    args = parser.parse_args()

    scenario = Scenario(seed=args.seed, quota_headroom=args.quota_headroom)
    if args.quick:
        scenario = dataclasses.replace(
            scenario, steady_s=50.0, warmup_s=10.0, burst_s=20.0, after_s=30.0
        )
    harness = Harness(
        time_scale=args.time_scale,
        tick_s=args.tick,
        bus_delay_s=args.bus_delay,
        latency_recover_ms=args.latency_recover_ms,
    )
    out_dir = output_dir("incident", args.quick)
    load_before = os.getloadavg()
    started = time.monotonic()

    traffic = arrivals(scenario)
    main_engine = scenario.engine(scenario.main_model)
    # Every GPU serves the main model without seawall: the arms share the same GPUs.
    gpus = scenario.main_gpus + scenario.small_gpus
    cores = [SimCore(main_engine, seed=i) for i in range(gpus)]
    uncontrolled = run_uncontrolled(traffic, cores, scenario.timeout_s)
    seawall, trace = SeawallRun(scenario, traffic, harness).run()
    fleet_load = load(scenario)
    sturdiness = None if args.quick else uncontrolled_growth(scenario)
    levels = [run_level(scenario, harness, level) for level in LEVELS]
    elapsed = time.monotonic() - started

    a, b = per_window(scenario, uncontrolled), per_window(scenario, seawall)
    by_ratio = ratios(b, a)
    growth_a = growth(a, a["steady"])
    growth_b = growth(b, b["steady"])
    vip_vs_a_steady = ratio(b["burst"]["vip"]["p99_s"], a["steady"]["vip"]["p99_s"])

    print(
        f"incident: {scenario.main_gpus} × {scenario.main_model} (main) + {scenario.small_gpus}"
        f" × {scenario.small_model} (small), {scenario.gpu}; {len(traffic)} requests, seed"
        f" {scenario.seed}\nsteady {scenario.steady_rate:g} req/s"
        f" ({100 * fleet_load['steady_share_of_saturation']:.0f}% of saturation), burst"
        f" ×{scenario.burst_factor:g} for {scenario.burst_s:g} s with"
        f" {100 * scenario.long_share:.0f}% long prompts"
        f" ({100 * fleet_load['burst_share_of_saturation']:.0f}% of that mix's saturation)"
    )
    print(
        f"virtual time; (b) composes the real policy cores; policy windows and holds ×"
        f"{harness.time_scale:g}, controller tick {harness.tick_s:g} s, bus hop"
        f" {harness.bus_delay_s:g} s"
    )
    for window in ("steady", "burst"):
        print_table(scenario, a, b, window)
    print("\nburst P99 / steady P99 of the same run (the steady window is the baseline):")
    for name, g in (("(a) no control plane", growth_a), ("(b) seawall", growth_b)):
        print(f"  {name:<22}" + "  ".join(f"{c} {fmt(v, '.2f')}x" for c, v in g.items()))
    print(f"  (b) VIP burst P99 / (a) VIP steady P99: {fmt(vip_vs_a_steady, '.2f')}x")
    if sturdiness is not None:
        print("  (a) alone, all classes, on other seeds and at ±10% steady rate:")
        for row in sturdiness["runs"]:
            print(
                f"    seed {row['seed']} {row['steady_rate']:4.1f} req/s: steady P99"
                f" {fmt(row['steady_p99_s'], '.2f')} s, burst {fmt(row['burst_p99_s'], '.2f')} s,"
                f" {fmt(row['burst_over_steady'], '.2f')}x"
            )
    onset, sustained = (b[w]["vip"]["p99_s"] for w in ("burst_onset", "burst_sustained"))
    print(
        f"  (b) VIP P99 in the burst's onset {fmt(onset, '.2f')} s, sustained"
        f" {fmt(sustained, '.2f')} s (see the windows in the JSON)"
    )
    for c in (*(c.value for c in CLASSES),):
        lost = b["burst"][c]["not_answered_by_reason"]
        degraded = b["burst"][c]["degraded_by_reason"]
        print(f"  (b) {c:<9} burst: not answered {lost or '{}'}, degraded {degraded or '{}'}")
    control = control_summary(scenario, trace)
    print("control decisions (b) after the warm-up, pool scope:")
    for d in control["pool_decisions"]:
        print(f"  {d['at_s']:7.2f} s  {d['key']:<24} {d['decision']:<22} {d['reason']}")
    print(
        f"  worker breakers: {control['worker_breaker_decisions']}; batch limits:"
        f" {control['batch_limit_moves']} (mean on main ≥"
        f" {fmt(control['min_mean_batch_limit_in_burst'], '.1f')} in the burst); largest"
        f" admission backlog: {control['max_backlog']}; answers after their client gave up:"
        f" {control['late_answers']}"
    )
    print_levels(levels)
    print(f"{elapsed:.0f}s in all")

    doc = document(scenario, harness, traffic_len=len(traffic), fleet_load=fleet_load)
    doc.update(
        elapsed_s=elapsed,
        machine={
            "cpus": mp.cpu_count(),
            "loadavg_before": load_before,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        levels=levels,
        highest_load_at_90pct_slo=highest_sustained(levels),
        results={"uncontrolled": a, "seawall": b},
        ratios_seawall_over_uncontrolled=by_ratio,
        burst_p99_over_steady_p99={
            "uncontrolled": growth_a,
            "seawall": growth_b,
            "seawall_vip_over_uncontrolled_vip_steady": vip_vs_a_steady,
            "uncontrolled_other_seeds_and_rates": sturdiness,
        },
        control=control
        | {
            "decisions": [
                dataclasses.asdict(c) for c in trace.changes if "batch_limit/" not in c.key
            ],
            "samples_per_s": trace.samples,
        },
    )
    (out_dir / "incident.json").write_text(json.dumps(doc, indent=2) + "\n")
    steady_all = {
        "uncontrolled": a["steady"]["all"]["p99_s"],
        "seawall": b["steady"]["all"]["p99_s"],
    }
    title = (
        f"Seed incident: ×{scenario.burst_factor:g} burst, {100 * scenario.long_share:.0f}% long"
        f" prompts (virtual time, seed {scenario.seed}; policy windows ×{harness.time_scale:g})"
    )
    plot(
        scenario,
        {"uncontrolled": uncontrolled, "seawall": seawall},
        trace,
        steady_all,
        out_dir / "incident.png",
        title,
    )
    plot_levels(levels, out_dir / "incident_levels.png", scenario.slo_s)
    print(f"wrote {out_dir / 'incident.json'}, {out_dir / 'incident.png'} and incident_levels.png")
    return 0


def document(
    scenario: Scenario, harness: Harness, *, traffic_len: int, fleet_load: dict[str, float]
) -> dict[str, Any]:
    main_engine = scenario.engine(scenario.main_model)
    small_engine = scenario.engine(scenario.small_model)
    return {
        "benchmark": "incident",
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "harness": (
            "one process, virtual time: simulated engines (sim_core, calibrated to vLLM V1) "
            "stepped in a discrete-event loop; in (b) the policy cores of admission, the "
            "workers and the controller composed as their service shells compose them, "
            "Kafka hops as fixed delays, quotas on the bucket model bucket.lua runs. Not the "
            "end-to-end path through Kafka and Redis (measured by the other benchmarks)."
        ),
        "runs": {
            "uncontrolled": (
                "(a) no control plane: everything admitted to the least-loaded main engine, "
                "batch limit max_num_seqs, vLLM's own queue; a timed-out client's request is "
                "aborted"
            ),
            "seawall": (
                "(b) quotas per tenant, VIP-floor priority scheduler, dispatch paced per worker "
                "in slots, KV and prefill tokens and placed on the worker admission chooses, "
                "engine priority policy, breaker matrix, degradation ladder, adaptive batch "
                "limit, deadlines"
            ),
        },
        "latency": (
            "arrival -> reply at the client, end to end (non-streaming answers); requests "
            "whose client gave up count at the timeout; refusals and canned replies untimed"
        ),
        "scenario": scenario.describe(),
        "requests": traffic_len,
        "quotas_per_tenant": {
            t.value: {
                "requests": dataclasses.asdict(c.requests),
                "tokens": dataclasses.asdict(c.tokens),
            }
            for t, c in tier_configs(scenario).items()
        },
        "engines": {
            "main": dataclasses.asdict(main_engine.limits()) | {"model": scenario.main_model},
            "small": dataclasses.asdict(small_engine.limits()) | {"model": scenario.small_model},
        },
        "fleet_load": fleet_load,
        "time_scale": harness.time_scale,
        "harness_settings": {
            k: sorted(t.value for t in v) if isinstance(v, frozenset) else v
            for k, v in dataclasses.asdict(harness).items()
        },
        "policy_windows_scaled": policy_windows(harness),
    }


if __name__ == "__main__":
    raise SystemExit(main())
