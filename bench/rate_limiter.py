"""Rate-limiter throughput: seawall's Redis token bucket against the ``limits`` library.

Every limiter decides on the same Redis. Each client has its own connection and one
operation in flight at a time (a request path waits for its decision); an operation is
one decision, except for ``seawall-batch``; clients use distinct keys, so this measures
throughput, not contention on one key. Clients are asyncio tasks spread over
``min(clients, cpus)`` processes: 8 clients on 2 cores are 2 processes of 4 (8 processes
would only take turns on the cores). The clients of a measurement start together (a
barrier, after their connections and scripts are warm) and stop together; decisions per
second = all their decisions / the duration.

- ``seawall``: ``RedisQuota.decide`` — one Lua script call deciding the request and
  token dimensions together (tokens and timestamp in one hash per dimension, Redis
  ``TIME``), its reply parsed into a ``QuotaDecision``: one decision per round trip.
- ``seawall-batch``: ``RedisQuota.decide_many`` of ``BATCH`` decisions (admission's
  ``intake_batch``, 200) per operation, as admission decides the requests of a fetch:
  script calls of up to 64 charges, pipelined, one round trip. Each decision is the same
  atomic charge as above; what is shared is the round trip and the tier's limits.
- ``limits-moving``: the ``limits`` library's Redis moving-window limiter (a Lua script
  over a list of hit timestamps); its API decides one hit per call.
- ``limits-moving-pipelined``: ``BATCH`` of those hits in one round trip: its own
  moving-window script queued that many times in a pipeline (``limits`` has no batch
  API), against which ``seawall-batch`` is compared.
- ``limits-fixed``: its fixed-window limiter (a Lua INCR + EXPIRE).
- ``python-evalsha``: the baseline — EVALSHA of a trivial script (``return 1``) through the
  same client stack (redis-py's asyncio client; ``limits`` is given the same, its
  ``redispy`` implementation), so the ratios isolate the limiters' own cost.
- ``redis-benchmark``: the ceiling — the same trivial EVALSHA from C (``redis-benchmark
  -c <clients>``, no pipelining: one request in flight per client, as here).

Every limiter is EVALSHA only, so Redis's own ``INFO commandstats`` (read before and
after each measurement) also gives the server's time per decision: what bounds a Redis
core shared by many clients. ``evalsha_calls_per_decision`` checks that nobody else used
the Redis meanwhile (1.0 if so; for ``seawall-batch``, 4 calls per 200 decisions).

The headline is like against like: ``seawall`` over ``limits-moving`` (one decision per
round trip each), and ``seawall-batch`` over ``limits-moving-pipelined`` (200 each).

Limits are high enough that every decision admits: a refusal costs the same, and an
admitted decision writes, which is the more expensive path.

Every limiter is measured ``--rounds`` times (3) for ``--duration`` s (3) each, the
limiters taking turns round after round; the figures are the medians of the rounds, so
that a few seconds' disturbance (this machine is shared) falls on one round of one
limiter rather than on its whole figure. ``redis-benchmark`` runs as many times.

Usage: ``python bench/rate_limiter.py [--duration 3] [--rounds 3] [--clients 1 8] [--quick]``.
Writes ``bench/results/rate_limiter.json`` and ``.png``; prints ratios against the
baseline and the ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import redis
import redis.asyncio as aioredis
from _common import commit, fmt, machine, output_dir, ratio
from limits import RateLimitItemPerSecond
from limits.aio.storage import RedisStorage
from limits.aio.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

from schemas import Tier
from services.admission.policy.bucket import Limit, TierConfig
from services.admission.policy.charges import QuotaRequest
from services.admission.quota import CHARGES_PER_CALL, RedisQuota
from services.admission.settings import AdmissionSettings
from services.common.settings import DEFAULT_REDIS_URL

BASELINE = "python-evalsha"
CEILING = "redis-benchmark"
BATCHED = "seawall-batch"
LIMITS_BATCHED = "limits-moving-pipelined"
LIMITERS = (BASELINE, "seawall", BATCHED, "limits-moving", LIMITS_BATCHED, "limits-fixed")
BATCH = AdmissionSettings.model_fields["intake_batch"].default
"""Decisions per round trip for ``seawall-batch``: what admission decides together (the
requests of one fetch, at most ``intake_batch``)."""
EXPECTED_CALLS = {BATCHED: math.ceil(BATCH / CHARGES_PER_CALL) / BATCH, LIMITS_BATCHED: 1.0}
"""EVALSHA calls per decision when nobody else uses the Redis (1 for the others)."""
TRIVIAL = "return 1"
ROOMY = TierConfig(Tier.ENTERPRISE, Limit(1e9, 1e9), Limit(1e12, 1e12))
WARMUP_OPS = 50
BARRIER_TIMEOUT_S = 120.0
CEILING_OPS_PER_CLIENT_S = 20_000
"""``redis-benchmark -n`` = this × clients × duration: a few seconds at its pace here."""


Op = Callable[[], Awaitable[object]]
"""One operation of a client: one decision, or for ``seawall-batch`` ``BATCH``."""


async def _make(name: str, url: str, prefix: str) -> Op:
    client = aioredis.Redis.from_url(url)
    tenant = f"bench-{uuid.uuid4().hex[:8]}"
    if name == BASELINE:
        sha = await client.script_load(TRIVIAL)
        return lambda: client.evalsha(sha, 0)
    if name == "seawall":
        quota = RedisQuota(client, prefix)
        return lambda: quota.decide(tenant, ROOMY, requests=1, tokens=100)
    if name == BATCHED:
        quota = RedisQuota(client, prefix)
        batch = [QuotaRequest(tenant, ROOMY, 1, 100)] * BATCH
        return lambda: quota.decide_many(batch)
    storage = RedisStorage(
        url.replace("redis://", "async+redis://", 1), implementation="redispy", key_prefix=prefix
    )
    item = RateLimitItemPerSecond(1_000_000_000)
    if name == LIMITS_BATCHED:
        return _limits_pipelined(storage, item, tenant)
    limiter_cls = MovingWindowRateLimiter if name == "limits-moving" else FixedWindowRateLimiter
    limiter = limiter_cls(storage)
    return lambda: limiter.hit(item, tenant)


def _limits_pipelined(storage: RedisStorage, item: RateLimitItemPerSecond, tenant: str) -> Op:
    """``BATCH`` moving-window hits in one round trip: ``limits`` has no batch API, so
    this queues its own moving-window script (what ``MovingWindowRateLimiter.hit`` runs,
    with the key and arguments it gives it: ``RedispyBridge.acquire_entry``) that many
    times in one pipeline, as a user of ``limits`` deciding a batch would have to."""
    bridge: Any = storage.bridge
    script = bridge.lua_acquire_moving_window
    key = bridge.prefixed_key(item.key_for(tenant))
    limit, expiry = item.amount, item.get_expiry()

    async def op() -> list[object]:
        pipe = bridge.get_connection().pipeline(transaction=False)
        now = time.time()
        for _ in range(BATCH):
            await script(keys=[key], args=[now, limit, expiry, 1], client=pipe)
        results: list[object] = await pipe.execute()
        return results

    return op


def decisions_per_op(name: str) -> int:
    return BATCH if name in (BATCHED, LIMITS_BATCHED) else 1


async def _run_for(op: Op, per_op: int, end: float) -> int:
    """Decisions made until ``end``."""
    done = 0
    while time.perf_counter() < end:
        await op()
        done += per_op
    return done


async def _clients(
    tasks: int,
    url: str,
    prefix: str,
    plan: tuple[int, float],
    phase: Barrier,
    out: Queue[Any],
) -> None:
    """``tasks`` clients in this process: ``rounds`` rounds of every limiter in turn, for
    ``duration_s`` each. Per measurement, three barrier phases shared with the main
    process: warm, go, done (see ``measure``)."""
    rounds, duration_s = plan
    ops = {name: [await _make(name, url, prefix) for _ in range(tasks)] for name in LIMITERS}
    for _ in range(rounds):
        for name in LIMITERS:
            for op in ops[name]:
                for _ in range(WARMUP_OPS // decisions_per_op(name) + 1):  # connection, caches
                    await op()
            phase.wait(BARRIER_TIMEOUT_S)  # warm
            phase.wait(BARRIER_TIMEOUT_S)  # go
            end = time.perf_counter() + duration_s
            per_op = decisions_per_op(name)
            counts = await asyncio.gather(*(_run_for(op, per_op, end) for op in ops[name]))
            out.put((name, sum(counts)))
            phase.wait(BARRIER_TIMEOUT_S)  # done


def _process_main(
    tasks: int, url: str, prefix: str, plan: tuple[int, float], phase: Barrier, out: Queue[Any]
) -> None:
    asyncio.run(_clients(tasks, url, prefix, plan, phase, out))


def evalsha_stats(client: redis.Redis) -> tuple[int, int]:
    """Redis's own count of EVALSHA calls and the microseconds it spent in them."""
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


@dataclass(frozen=True)
class Measured:
    ops_per_s: float
    """Decisions per second."""
    server_us_per_decision: float
    """Redis's time in EVALSHA (``INFO commandstats``) over the measurement, per
    decision."""
    calls_per_op: float
    """EVALSHA calls Redis counted per decision made here: ``EXPECTED_CALLS`` unless
    someone else used this Redis meanwhile (then the server time is mixed with
    theirs)."""


def measure(
    clients: int, url: str, prefix: str, rounds: int, duration_s: float
) -> dict[str, list[Measured]]:
    """Decisions per second of ``clients`` clients together, per limiter and round. The
    clients are spread over ``min(clients, cpus)`` processes (more would only take turns
    on the cores); the same processes measure every limiter, one after the other, round
    after round, so that a disturbance of a few seconds falls on one limiter's round, not
    on all of its figure. This process reads Redis's EVALSHA statistics between the
    barrier phases *warm* (every client warmed up) and *go*, and again once every count
    came in, before *done* lets the clients on to the next warm-up."""
    ctx = mp.get_context("spawn")
    n = min(clients, os.cpu_count() or 1)
    phase = ctx.Barrier(n + 1)
    out: Queue[Any] = ctx.Queue()
    plan = (rounds, duration_s)
    procs = [
        ctx.Process(
            target=_process_main,
            args=(clients // n + (i < clients % n), url, prefix, plan, phase, out),
        )
        for i in range(n)
    ]
    for proc in procs:
        proc.start()
    stats = redis.Redis.from_url(url)
    measured: dict[str, list[Measured]] = {name: [] for name in LIMITERS}
    try:
        for _ in range(rounds):
            for name in LIMITERS:
                phase.wait(BARRIER_TIMEOUT_S)  # warm
                calls, usec = evalsha_stats(stats)
                phase.wait(BARRIER_TIMEOUT_S)  # go
                done = 0
                for _ in range(n):
                    got, count = out.get(timeout=BARRIER_TIMEOUT_S)
                    assert got == name
                    done += count
                calls_after, usec_after = evalsha_stats(stats)
                phase.wait(BARRIER_TIMEOUT_S)  # done
                calls = calls_after - calls
                measured[name].append(
                    Measured(
                        done / duration_s,
                        (usec_after - usec) / max(1, done),
                        calls / max(1, done),
                    )
                )
    finally:
        stats.close()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    return measured


def redis_benchmark(binary: str, url: str, clients: int, requests: int) -> float | None:
    parsed = urlparse(url)
    client = redis.Redis.from_url(url)
    try:
        sha = client.script_load(TRIVIAL)
    finally:
        client.close()
    argv = [binary, "-h", parsed.hostname or "127.0.0.1", "-p", str(parsed.port or 6379)]
    argv += ["-q", "-n", str(requests), "-c", str(clients), "EVALSHA", sha, "0"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
    found = re.findall(r"([\d.]+) requests per second", out)
    return float(found[-1]) if found else None


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def forget(url: str, prefix: str) -> None:
    """Delete this run's keys (they expire within seconds anyway)."""
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for i in range(0, len(keys), 1000):
            client.unlink(*keys[i : i + 1000])
    finally:
        client.close()


def plot(
    results: dict[str, dict[str, float | None]],
    server_us: dict[str, dict[str, float]],
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(3, 2))
    names = [*LIMITERS, CEILING]
    width = 0.8 / max(1, len(results))
    for i, (clients, row) in enumerate(results.items()):
        values = [row.get(n) or 0.0 for n in names]
        xs = [x + i * width for x in range(len(names))]
        bars = left.bar(xs, values, width, label=f"{clients} client(s)")
        base = row.get(BASELINE)
        labels = [f"{ratio(v, base):.2f}x" if v and base else "n/a" for v in values]
        left.bar_label(bars, labels, fontsize=7)
        us = [server_us[clients].get(n, 0.0) for n in LIMITERS]
        right.bar(xs[: len(LIMITERS)], us, width, label=f"{clients} client(s)")
    left.set_xticks([x + width * (len(results) - 1) / 2 for x in range(len(names))], names)
    left.tick_params(axis="x", labelsize=8)
    left.set_ylabel("decisions per second (log)")
    left.set_yscale("log")
    left.set_title("Decisions per second (labels: vs python-evalsha)")
    left.legend(fontsize=8)
    right.set_xticks([x + width * (len(results) - 1) / 2 for x in range(len(LIMITERS))], LIMITERS)
    right.tick_params(axis="x", labelsize=8)
    right.set_ylabel("microseconds")
    right.set_title("Redis time per decision (commandstats, EVALSHA)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per limiter")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--quick", action="store_true", help="a short trial run: 1 round of 1 s")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.rounds = min(args.duration, 1.0), 1

    load_before = os.getloadavg()
    started = time.monotonic()
    binary = shutil.which("redis-benchmark")
    if binary is None:
        print(
            "redis-benchmark is not on PATH: the ceiling is not measured "
            "(install it with the Redis tools, e.g. apt-get install redis-tools)."
        )
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    results: dict[str, dict[str, float | None]] = {}
    rounds: dict[str, dict[str, list[float | None]]] = {}
    server_us: dict[str, dict[str, float]] = {}
    calls_per_op: dict[str, dict[str, float]] = {}
    try:
        for clients in args.clients:
            measured = measure(clients, args.redis_url, prefix, args.rounds, args.duration)
            per_round: dict[str, list[float | None]] = {
                name: [m.ops_per_s for m in ms] for name, ms in measured.items()
            }
            per_round[CEILING] = [None]
            if binary is not None:
                n = int(CEILING_OPS_PER_CLIENT_S * clients * args.duration)
                per_round[CEILING] = [
                    redis_benchmark(binary, args.redis_url, clients, n) for _ in range(args.rounds)
                ]
            c = str(clients)
            rounds[c] = per_round
            results[c] = {name: median(values) for name, values in per_round.items()}
            server_us[c] = {
                name: statistics.median(m.server_us_per_decision for m in ms)
                for name, ms in measured.items()
            }
            calls_per_op[c] = {
                name: max(m.calls_per_op for m in ms) for name, ms in measured.items()
            }
    finally:
        forget(args.redis_url, prefix)
    elapsed = time.monotonic() - started

    ratios = {c: {n: ratio(v, row[BASELINE]) for n, v in row.items()} for c, row in results.items()}
    ceiling_ratios = {
        c: {n: ratio(v, row[CEILING]) for n, v in row.items()} for c, row in results.items()
    }
    print(
        f"{'clients':>7}  {'limiter':<25}{'ops/s':>10}{'vs evalsha':>12}{'vs ceiling':>12}"
        f"{'Redis µs/decision':>19}"
    )
    for clients, row in results.items():
        for name, value in row.items():
            vs_base = times(ratios[clients][name])
            vs_ceiling = times(ceiling_ratios[clients][name])
            us = fmt(server_us[clients].get(name), ".1f")
            print(
                f"{clients:>7}  {name:<25}{fmt(value, '.0f'):>10}{vs_base:>12}{vs_ceiling:>12}"
                f"{us:>19}"
            )
    mixed = {
        c: {n: round(x, 3) for n, x in row.items() if abs(x / EXPECTED_CALLS.get(n, 1) - 1) > 0.01}
        for c, row in calls_per_op.items()
    }
    if any(mixed.values()):
        print(f"others used this Redis meanwhile (EVALSHA calls per decision): {mixed}")
    for clients, figures in results.items():
        print(
            f"{clients} client(s): seawall over limits' moving window, one decision a round "
            f"trip each {times(ratio(figures['seawall'], figures['limits-moving']))}; "
            f"{BATCH} a round trip each "
            f"{times(ratio(figures[BATCHED], figures[LIMITS_BATCHED]))}"
        )
    if binary is None:
        print("no ceiling: redis-benchmark is not on PATH")
    print(f"load average at the start {load_before[0]:.2f}; {elapsed:.0f}s in all")

    out = output_dir("rate_limiter", args.quick)
    info = redis.Redis.from_url(args.redis_url).info("server")
    doc: dict[str, Any] = {
        "benchmark": "rate_limiter",
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "unit": "decisions per second",
        "baseline": BASELINE,
        "ceiling": CEILING if binary is not None else None,
        "ceiling_note": None if binary is not None else "redis-benchmark not found on PATH",
        "clients_are": "asyncio tasks over min(clients, cpus) processes; own connection, one "
        f"operation in flight each, distinct keys; an operation is one decision, or {BATCH} "
        f"for {BATCHED} (RedisQuota.decide_many, as admission decides a fetch)",
        "limits_implementation": "redispy (the same client stack as the baseline)",
        "duration_s_per_measurement": args.duration,
        "rounds": args.rounds,
        "figures_are": "the median of the rounds (each round measures every limiter in turn)",
        "quick": args.quick,
        "machine": machine(load_before, redis=str(info["redis_version"])),
        "elapsed_s": elapsed,
        # The headline, like against like: one decision per round trip each ...
        "seawall_single_over_limits_moving_window": {
            clients: ratio(figures["seawall"], figures["limits-moving"])
            for clients, figures in results.items()
        },
        # ... and a batch of BATCH decisions per round trip each (seawall as admission
        # decides a fetch; limits' moving-window script pipelined as many times).
        "seawall_batch_over_limits_moving_window_pipelined": {
            clients: ratio(figures[BATCHED], figures[LIMITS_BATCHED])
            for clients, figures in results.items()
        },
        "batch": BATCH,
        "results": results,
        "results_per_round": rounds,
        "ratios_vs_baseline": ratios,
        "ratios_vs_ceiling": ceiling_ratios,
        "redis_server_us_per_decision": server_us,
        "evalsha_calls_per_decision": calls_per_op,
    }
    (out / "rate_limiter.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, server_us, out / "rate_limiter.png")
    print(f"wrote {out / 'rate_limiter.json'} and {out / 'rate_limiter.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
