"""Dispatch round against fleet size: what admission spends measuring the pools for one
dispatch round, as the fleet grows, against reading one second of that fleet's telemetry.

In-process, admission's own pacing rule (``services.admission.policy.capacity``), no
broker: the cost is pure Python, and a round's share of admission's CPU is its cost
times the rounds a second (every request accepted and every report read asks for one).
For ``W`` workers spread over six pools (``--workers``, default 12, 120, 1,000 and
5,000):

- the fleet: each worker's ``WorkerReport`` (``EngineStats``, heartbeat, one GPU, the
  summary of its requests: what ``services/workers`` sends each second), read at a time
  of its own within the last second; each worker owns one partition of its pool's
  dispatch topic, as deployed, so admission places requests on workers; 13 requests in
  flight on each worker (the vLLM saturation of a 7B on one GPU cited in
  ``CALIBRATION.md``), dispatched at times spread over the last second and placed on
  it, so every worker has dispatches its report does not reflect yet;
- *round*: ``FleetCapacity.budget`` of every pool, as a round with work for every pool
  measures them (a round measures only the pools it has work for);
- *baseline, the fleet's second*: decoding the ``W`` reports and feeding them to the
  pacing rule (``decode`` + ``FleetCapacity.observe``), which admission's telemetry tail
  does every second whatever the rounds cost;
- *placing*: one pool's round with ``ROUND`` requests of work (no session: the usual
  request over HTTP), its budget measured and each request that fits placed on a
  worker (``RoundBudget.fits`` + ``take``), per request placed; *baseline*: the same
  round where the workers report no partitions (the record's key places it), in the
  same run.

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

from _common import commit, engine_stats, fmt, gpu_stats, heartbeat, machine, output_dir, ratio

from schemas import WorkerReport
from seawall_client.serde import TELEMETRY, decode, encode
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.cost import Cost

POOLS = tuple(f"pool-{i}" for i in range(6))
IN_FLIGHT = 13
ROUND = 200
PROMPT_TOKENS, MAX_TOKENS = 230, 256
NOW = 10_000.0
"""The monotonic time of the round."""


def reports(workers: int, rnd: random.Random, owned: bool = True) -> list[tuple[float, bytes]]:
    """Each worker's report as its record carries it, and when admission read it;
    ``owned``: each worker owns a partition of its pool's dispatch topic."""
    out = []
    for i in range(workers):
        worker, pool = f"w{i}", POOLS[i % len(POOLS)]
        at = time.time()
        beat = heartbeat(worker, pool, at, in_flight=IN_FLIGHT, started_at=at - 60)
        if owned:
            beat = beat.model_copy(update={"partitions": (i // len(POOLS),)})
        report = WorkerReport(
            worker_id=worker,
            pool=pool,
            at=at,
            heartbeat=beat,
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


def place_round(capacity: FleetCapacity) -> int:
    """One round of ``ROUND`` requests for the first pool: how many were placed."""
    cost = Cost(PROMPT_TOKENS, MAX_TOKENS)
    _, budget = capacity.budget(POOLS[0], NOW)
    placed = 0
    for i in range(ROUND):
        if budget.fits(cost, vip=False):
            budget.take(cost, key=f"p{i}")
            placed += 1
    return placed


def measure(workers: int, repeats: int) -> dict[str, float]:
    fleet = reports(workers, random.Random(workers))
    capacity = fleet_with_dispatches(fleet, random.Random(-workers))
    second = best(lambda: read(fleet, FleetCapacity()), repeats)
    first = best(lambda: [capacity.budget(p, NOW) for p in POOLS], 1)
    round_s = best(lambda: [capacity.budget(p, NOW) for p in POOLS], repeats)
    unowned = reports(workers, random.Random(workers), owned=False)
    by_key = fleet_with_dispatches(unowned, random.Random(-workers))
    placed = place_round(capacity)
    if place_round(by_key) != placed:
        raise RuntimeError("placing and the baseline dispatched different rounds")
    place_s = best(lambda: place_round(capacity), repeats)
    by_key_s = best(lambda: place_round(by_key), repeats)
    return {
        "round_ms": round_s * 1e3,
        "first_round_ms": first * 1e3,
        "fleet_second_ms": second * 1e3,
        "round_per_worker_us": round_s / workers * 1e6,
        "placed": placed,
        "place_per_request_us": place_s / placed * 1e6,
        "by_key_per_request_us": by_key_s / placed * 1e6,
    }


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, right) = plt.subplots(1, 2, figsize=(12, 4.5))
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
    ax.set_title("Measuring every pool for a round (labels: round / baseline)", fontsize=10)
    ax.legend(fontsize=8)
    for key, label in (
        ("place_per_request_us", "placed on a worker (workers own partitions)"),
        ("by_key_per_request_us", "baseline: placed by the record's key"),
    ):
        right.plot(ws, [results[str(w)][key] for w in ws], marker="o", label=label)
    right.set_xscale("log")
    right.set_xlabel("workers (six pools; one pool's round)")
    right.set_ylabel("µs per request placed (best of the repeats)")
    right.set_title(f"A round of {ROUND} requests for one pool", fontsize=10)
    right.legend(fontsize=8)
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
        f"{'µs/worker':>10} {'placed':>7} {'place µs':>9} {'by key µs':>10} {'ratio':>7}"
    )
    for workers in args.workers:
        r = results[str(workers)] = measure(workers, args.repeats)
        print(
            f"{workers:>8} {r['round_ms']:>10.2f} {r['first_round_ms']:>10.2f} "
            f"{r['fleet_second_ms']:>11.2f} "
            f"{fmt(ratio(r['round_ms'], r['fleet_second_ms']), '.2f'):>6}x "
            f"{r['round_per_worker_us']:>10.2f} {r['placed']:>7.0f} "
            f"{r['place_per_request_us']:>9.2f} {r['by_key_per_request_us']:>10.2f} "
            f"{fmt(ratio(r['place_per_request_us'], r['by_key_per_request_us']), '.2f'):>6}x"
        )
    out = output_dir("dispatch_round", args.quick)
    doc = {
        "benchmark": "dispatch_round",
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "unit": "milliseconds of CPU (in-process, best of the repeats)",
        "measures": {
            "round_ms": "FleetCapacity.budget of every pool (six), the fleet's reports read "
            f"over the last second, {IN_FLIGHT} requests in flight per worker dispatched "
            "over the last second and placed on it",
            "first_round_ms": "the same, the first time (nothing remembered yet)",
            "fleet_second_ms": "baseline: decode + FleetCapacity.observe of one WorkerReport "
            "per worker (one second of the fleet's telemetry)",
            "place_per_request_us": f"one pool's round of {ROUND} requests without a session: "
            "its budget measured, each request that fits placed on a worker (fits + take), "
            "per request placed",
            "by_key_per_request_us": "baseline: the same round, the workers reporting no "
            "partitions (the record's key places each request)",
        },
        "repeats": args.repeats,
        "quick": args.quick,
        "machine": machine(load_before),
        "elapsed_s": time.monotonic() - started,
        "round_over_fleet_second": {
            w: ratio(r["round_ms"], r["fleet_second_ms"]) for w, r in results.items()
        },
        "place_over_by_key": {
            w: ratio(r["place_per_request_us"], r["by_key_per_request_us"])
            for w, r in results.items()
        },
        "results": results,
    }
    (out / "dispatch_round.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, out / "dispatch_round.png")
    print(f"wrote {out / 'dispatch_round.json'} and {out / 'dispatch_round.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
