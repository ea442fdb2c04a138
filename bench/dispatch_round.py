"""Dispatch round against fleet size: what admission spends measuring the pools for one
dispatch round, as the fleet grows, against reading one second of that fleet's telemetry.

In-process, admission's own pacing rule (``services.admission.policy.capacity``), no
broker: the cost is pure Python, and a round's share of admission's CPU is its cost
times the rounds a second (every request accepted and every report read asks for one).
For ``W`` workers spread over six pools (``--workers``, default 12, 120, 1,000 and
5,000):

- the fleet: each worker's ``WorkerReport`` (``EngineStats``, heartbeat, one GPU, the
  summary of its requests: what ``services/workers`` sends each second), read at a time
  of its own within the last second; 13 requests in flight on each worker (the vLLM
  saturation of a 7B on one GPU cited in ``CALIBRATION.md``), dispatched at times spread
  over the last second and placed on it, so every worker has dispatches its report does
  not reflect yet;
- *round*: ``FleetCapacity.budget`` of every pool, as a round with work for every pool
  measures them (a round measures only the pools it has work for);
- *baseline, the fleet's second*: decoding the ``W`` reports and feeding them to the
  pacing rule (``decode`` + ``FleetCapacity.observe``), which admission's telemetry tail
  does every second whatever the rounds cost.

Each figure is the best of ``--repeats`` timings (the machine's other work only adds).
A ratio of 0.1 means that ten rounds a second cost admission as much again as reading
the fleet's telemetry.

Usage: ``python bench/dispatch_round.py [--workers 12 120 1000 5000] [--repeats 7]
[--quick]``. Writes ``bench/results/dispatch_round.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _common import engine_stats, fmt, gpu_stats, heartbeat, machine, output_dir, ratio

from schemas import WorkerReport
from seawall_client.serde import TELEMETRY, decode, encode
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.cost import Cost

POOLS = tuple(f"pool-{i}" for i in range(6))
IN_FLIGHT = 13
PROMPT_TOKENS, MAX_TOKENS = 230, 256
NOW = 10_000.0
"""The monotonic time of the round."""


def reports(workers: int, rnd: random.Random) -> list[tuple[float, bytes]]:
    """Each worker's report as its record carries it, and when admission read it."""
    out = []
    for i in range(workers):
        worker, pool = f"w{i}", POOLS[i % len(POOLS)]
        at = time.time()
        report = WorkerReport(
            worker_id=worker,
            pool=pool,
            at=at,
            heartbeat=heartbeat(worker, pool, at, in_flight=IN_FLIGHT, started_at=at - 60),
            engine=engine_stats(
                worker,
                pool,
                at,
                in_flight=IN_FLIGHT,
                kv_cache_usage=0.4,
                kv_capacity_tokens=119_184,
            ),
            gpus=(gpu_stats(worker, pool, at, 60.0),),
        )
        out.append((NOW - rnd.random(), encode(report)))
    return out


def read(fleet: list[tuple[float, bytes]], capacity: FleetCapacity) -> None:
    for read_at, raw in fleet:
        capacity.observe(decode(TELEMETRY, raw), read_at)


def fleet_with_dispatches(fleet: list[tuple[float, bytes]], rnd: random.Random) -> FleetCapacity:
    capacity = FleetCapacity()
    read(sorted(fleet), capacity)
    cost = Cost(PROMPT_TOKENS, MAX_TOKENS)
    times = sorted((NOW - rnd.random(), i) for i in range(len(fleet)) for _ in range(IN_FLIGHT))
    for n, (at, i) in enumerate(times):
        capacity.dispatched(POOLS[i % len(POOLS)], f"r{n}", at, cost, f"w{i}")
    return capacity


def best(run: Callable[[], object], repeats: int) -> float:
    """The shortest of ``repeats`` timings of ``run``, in seconds."""
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return min(timings)


def measure(workers: int, repeats: int) -> dict[str, float]:
    rnd = random.Random(workers)
    fleet = reports(workers, rnd)
    capacity = fleet_with_dispatches(fleet, rnd)
    second = best(lambda: read(fleet, FleetCapacity()), repeats)
    first = best(lambda: [capacity.budget(p, NOW) for p in POOLS], 1)
    round_s = best(lambda: [capacity.budget(p, NOW) for p in POOLS], repeats)
    return {
        "round_ms": round_s * 1e3,
        "first_round_ms": first * 1e3,
        "fleet_second_ms": second * 1e3,
        "round_per_worker_us": round_s / workers * 1e6,
    }


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ws = [int(w) for w in results]
    for key, label in (
        ("round_ms", "a round: every pool measured"),
        ("fleet_second_ms", "baseline: one second of the fleet's reports read"),
    ):
        ax.plot(ws, [results[str(w)][key] for w in ws], marker="o", label=label)
    for w in ws:
        r = results[str(w)]
        ax.annotate(
            f"{ratio(r['round_ms'], r['fleet_second_ms']):.2f}x",
            (w, r["round_ms"]),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("workers (six pools)")
    ax.set_ylabel("milliseconds (best of the repeats)")
    ax.set_title("Admission's dispatch round against fleet size (labels: round / baseline)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[12, 120, 1_000, 5_000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a short trial: 12 and 120 workers")
    args = parser.parse_args()
    if args.quick:
        args.workers, args.repeats = [w for w in args.workers if w <= 120] or [12], 3

    load_before = os.getloadavg()
    started = time.monotonic()
    results: dict[str, dict[str, float]] = {}
    print(
        f"{'workers':>8} {'round ms':>10} {'first ms':>10} {'fleet s ms':>11} {'ratio':>7} "
        f"{'µs/worker':>10}"
    )
    for workers in args.workers:
        r = results[str(workers)] = measure(workers, args.repeats)
        print(
            f"{workers:>8} {r['round_ms']:>10.2f} {r['first_round_ms']:>10.2f} "
            f"{r['fleet_second_ms']:>11.2f} "
            f"{fmt(ratio(r['round_ms'], r['fleet_second_ms']), '.2f'):>6}x "
            f"{r['round_per_worker_us']:>10.2f}"
        )
    out = output_dir("dispatch_round", args.quick)
    doc = {
        "benchmark": "dispatch_round",
        "unit": "milliseconds of CPU (in-process, best of the repeats)",
        "measures": {
            "round_ms": "FleetCapacity.budget of every pool (six), the fleet's reports read "
            f"over the last second, {IN_FLIGHT} requests in flight per worker dispatched "
            "over the last second and placed on it",
            "first_round_ms": "the same, the first time (nothing remembered yet)",
            "fleet_second_ms": "baseline: decode + FleetCapacity.observe of one WorkerReport "
            "per worker (one second of the fleet's telemetry)",
        },
        "repeats": args.repeats,
        "quick": args.quick,
        "machine": machine(load_before),
        "elapsed_s": time.monotonic() - started,
        "round_over_fleet_second": {
            w: ratio(r["round_ms"], r["fleet_second_ms"]) for w, r in results.items()
        },
        "results": results,
    }
    (out / "dispatch_round.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, out / "dispatch_round.png")
    print(f"wrote {out / 'dispatch_round.json'} and {out / 'dispatch_round.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
