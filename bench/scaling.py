"""How cost grows: the controller against a fleet's telemetry (100 to 5,000 workers),
and admission's quota path and Redis memory against tenants (10, 10k, 100k).

**Part 1, the controller** (``_scaling_controller``). On the embedded broker, per fleet
size, a load generator process (``_scaling_fleet``) plays ``W`` synthetic workers whose
telemetry is read by a bare consumer (the baseline), then by one and by two controller
processes (``python -m services.controller``). Measured per phase: the consumer lag on
the telemetry and internal topics, the rate of records decided, the reaction to a hot GPU
sample (``DegradationLevel`` 3 on the control topic) against the broker's round trip to
the same reader, and CPU; also the size of a pool's changelog record at each scale.

**Part 2, admission and Redis** (``_scaling_admission``). On the local Redis, for ``T``
tenants written in the ingress keystore's layout: rounds of ``RedisQuota.decide_many``
(admission's quota call) against pipelined rounds of a trivial EVALSHA, and the Redis
memory the tenants' keys and buckets take.

Usage: ``python bench/scaling.py [--duration 20] [--quick]``. Writes
``bench/results/scaling.json`` and ``.png`` (``--quick``: a short trial, written to a
temporary directory); prints ratios against the baselines measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from _common import EMBEDDED_BROKER, commit, embedded_broker, fmt, machine, output_dir, ratio
from _scaling_admission import INTAKE_BATCH, TENANTS, admission_part
from _scaling_controller import (
    BEHIND_SLOPE,
    PARTITIONS,
    POOLS,
    SCALES,
    Bench,
    Phase,
    analyse,
    record_cost,
)
from _scaling_fleet import TELEMETRY_INTERVAL_S
from _scaling_plot import plot

REQUESTS_PER_WORKER_S = 13.2
"""The vLLM saturation of one GPU serving a 7B model that ``CALIBRATION.md`` cites: a busy
fleet."""


def print_report(doc: dict[str, Any]) -> None:
    figures = doc["controller"]["figures"]
    bare = {f["workers"]: f for f in figures if f["controllers"] == 0}
    print(
        f"{'phase':<28}{'offered/s':>10}{'sent/s':>8}{'/bare':>6}{'decided/s':>10}{'/bare':>6}"
        f"{'lag':>9}{'internal':>9}{'backlog s':>10}{'slope':>6}{'behind':>7}"
        f"{'react p50':>10}{'/ping':>7}{'missed':>7}"
    )
    for f in figures:
        b = bare.get(f["workers"], {})
        base_sent = b.get("sent_per_s")
        ping = (b.get("ping_ms") or {}).get("p50")
        print(
            f"{f['label']:<28}{f['offered_per_s']:>10.0f}{f['sent_per_s']:>8.0f}"
            f"{fmt(ratio(f['sent_per_s'], base_sent), '.2f'):>6}"
            f"{fmt(f['processed_per_s'], '.0f'):>10}"
            f"{fmt(ratio(f['processed_per_s'], base_sent), '.2f'):>6}"
            f"{fmt(f['lag_end'], '.0f'):>9}{fmt(f['lag_internal_end'], '.0f'):>9}"
            f"{fmt(f['backlog_end_s'], '.1f'):>10}"
            f"{fmt(f['backlog_slope_vs_sent'], '.2f'):>6}{'yes' if f['behind'] else 'no':>7}"
            f"{fmt(f['reaction_ms']['p50'], '.0f'):>10}"
            f"{fmt(ratio(f['reaction_ms']['p50'], ping), '.0f'):>7}"
            f"{f['missed'] if f['controllers'] else '':>7}"
        )
    for r in doc["controller"]["records"]:
        print(
            f"pool of {r['workers_per_pool']} workers: a worker's changelog record "
            f"{r['worker_record_bytes']} B (encoded in {r['encode_ms']:.3f} ms), the pool's "
            f"{r['pool_record_bytes']} B; first sight of all of them writes "
            f"{r['first_sight_bytes'] / 1e6:.2f} MB"
        )
    admission = doc["admission"]
    base = admission["trivial_evalsha_per_s"]
    print(
        f"\n{'tenants':>8}{'decisions/s':>13}{'vs trivial':>11}{'vs first':>9}"
        f"{'ingress B/tenant':>18}{'(MEMORY USAGE)':>16}{'buckets B/tenant':>18}"
        f"{'live buckets':>14}{'MiB delta':>11}"
    )
    first = admission["phases"][0]["decisions_per_s"] if admission["phases"] else None
    for p in admission["phases"]:
        usage = p["memory_usage_per_tenant"]
        print(
            f"{p['tenants']:>8}{p['decisions_per_s']:>13.0f}"
            f"{fmt(ratio(p['decisions_per_s'], base), '.2f'):>11}"
            f"{fmt(ratio(p['decisions_per_s'], first), '.2f'):>9}"
            f"{p['ingress_records_delta_per_tenant']:>18.0f}"
            f"{p['memory_usage_ingress_per_tenant']:>16.0f}"
            f"{usage.get('quota_requests', 0) + usage.get('quota_tokens', 0):>18.0f}"
            f"{p['live_buckets']:>14}{p['used_memory_delta_bytes'] / 2**20:>11.2f}"
        )
    print(f"baseline: trivial EVALSHA in the same pipelined rounds, {base:.0f}/s")


def within_1s(figures: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per number of controller processes, the most workers whose every hot-GPU trigger
    became a decision read within 1 s and whose backlog was not growing (``None``:
    not even the smallest scale)."""
    out: dict[str, int | None] = {}
    for controllers in (1, 2):
        fit = [
            f["workers"]
            for f in figures
            if f["controllers"] == controllers
            and f["reactions"]
            and not f["missed"]
            and not f["behind"]
            and (f["reaction_ms"]["max"] or 0.0) <= 1000.0
        ]
        out[str(controllers)] = max(fit, default=None)
    return out


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    async with embedded_broker(workdir) as bootstrap:
        bench = Bench(args, bootstrap, workdir)
        phases: list[Phase] = []
        for workers in args.scales:
            for controllers in (0, 1, 2):
                phase = await bench.phase(workers, controllers)
                phases.append(phase)
                f = analyse(phase)
                print(
                    f"  {phase.label}: sent {f['sent_per_s']:.0f}/s, "
                    f"decided {fmt(f['processed_per_s'], '.0f')}/s, lag {f['lag_end']}, "
                    f"reactions {fmt(f['reaction_ms']['p50'], '.0f')} ms p50 "
                    f"({f['missed']} missed), CPU {f['machine_busy']:.0%}",
                    flush=True,
                )
        admission = await admission_part(args, bootstrap)
    return {
        "controller": {
            "pools": list(bench.pools),
            "records": [record_cost(-(-w // POOLS)) for w in args.scales],
            "phases": [asdict(p) | {"label": p.label} for p in phases],
            "figures": [analyse(p) for p in phases],
        },
        "admission": admission,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per phase")
    parser.add_argument(
        "--baseline-duration", type=float, default=6.0, help="seconds of load, bare consumer"
    )
    parser.add_argument("--scales", type=int, nargs="+", default=list(SCALES), help="workers")
    parser.add_argument("--tenants", type=int, nargs="+", default=list(TENANTS))
    parser.add_argument("--decide-s", type=float, default=3.0, help="seconds of quota decisions")
    parser.add_argument(
        "--requests-per-worker", type=float, default=REQUESTS_PER_WORKER_S, help="per second"
    )
    parser.add_argument("--tick", type=float, default=1.0, help="SEAWALL_CONTROLLER_TICK_S")
    parser.add_argument(
        "--quick", action="store_true", help="short trial run, written to a temporary directory"
    )
    args = parser.parse_args()
    if args.quick:
        args.duration, args.baseline_duration, args.decide_s = 6.0, 3.0, 1.0
        args.tenants = [10, 1_000, 10_000]

    load_before = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="seawall-scaling-") as tmp:
        doc = asyncio.run(run(args, Path(tmp)))
    elapsed = time.monotonic() - started
    doc = {
        "benchmark": "scaling",
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": {
            "scales": args.scales,
            "tenants": args.tenants,
            "duration_s": args.duration,
            "baseline_duration_s": args.baseline_duration,
            "decide_s": args.decide_s,
            "requests_per_worker_s": args.requests_per_worker,
            "telemetry_interval_s": TELEMETRY_INTERVAL_S,
            "records_per_worker_s": 1 / TELEMETRY_INTERVAL_S,
            "completions_per_worker_s": args.requests_per_worker,
            "partitions": PARTITIONS,
            "controller_tick_s": args.tick,
            "controller_time_scale": 1.0,
            "behind_if_lag_slope_over": BEHIND_SLOPE,
            "intake_batch": INTAKE_BATCH,
            "quick": args.quick,
        },
        "machine": machine(load_before, broker=EMBEDDED_BROKER),
        "elapsed_s": elapsed,
        # the figure issue 15 compares from run to run
        "max_workers_within_1s_reaction": within_1s(doc["controller"]["figures"]),
        **doc,
    }
    print_report(doc)
    print(f"{elapsed:.0f}s in all")
    # A trial run must not replace the recorded figures.
    out = output_dir("scaling", args.quick)
    (out / "scaling.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, out / "scaling.png")
    print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
