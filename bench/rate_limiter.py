"""Rate-limiter throughput: seawall's Redis token bucket against the ``limits`` library.

Every limiter makes one decision per operation on the same Redis. Each client is its
own process running one decision at a time (a request path waits for its decision);
clients use distinct keys, so this measures throughput, not contention on one key.

- ``seawall``: ``RedisQuota.decide`` — one Lua script deciding the request and token
  dimensions together (tokens and timestamp in one hash per dimension, Redis ``TIME``).
- ``limits-moving``: the ``limits`` library's Redis moving-window limiter.
- ``limits-fixed``: its fixed-window limiter.
- ``python-evalsha``: the baseline — EVALSHA of a trivial script through the same
  client stack (redis-py, asyncio), so the ratios isolate the limiters' own cost.
- ``redis-benchmark``: the ceiling — the same trivial EVALSHA from C.

Usage: ``python bench/rate_limiter.py [--duration 5] [--redis-url redis://127.0.0.1:6379/0]``.
Writes ``bench/results/rate_limiter.json`` and ``.png``; prints ratios against the
baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlparse

import redis.asyncio as aioredis
from limits import RateLimitItemPerSecond
from limits.aio.storage import RedisStorage
from limits.aio.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

from schemas import Tier
from services.admission.bucket import Limit, TierConfig
from services.admission.quota import RedisQuota

RESULTS = Path(__file__).parent / "results"
LIMITERS = ("python-evalsha", "seawall", "limits-moving", "limits-fixed")
TRIVIAL = "return 1"
# Limits high enough that every decision admits: a refusal costs the same, and an
# admitted decision writes, which is the more expensive path.
ROOMY = TierConfig(Tier.ENTERPRISE, Limit(1e9, 1e9), Limit(1e12, 1e12))


async def _make(name: str, url: str, prefix: str) -> Callable[[], Awaitable[object]]:
    client = aioredis.Redis.from_url(url)
    tenant = f"bench-{uuid.uuid4().hex[:8]}"
    if name == "python-evalsha":
        sha = await client.script_load(TRIVIAL)
        return lambda: client.evalsha(sha, 0)
    if name == "seawall":
        quota = RedisQuota(client, prefix)
        return lambda: quota.decide(tenant, ROOMY, requests=1, tokens=100)
    storage = RedisStorage(url.replace("redis://", "async+redis://", 1))
    limiter_cls = MovingWindowRateLimiter if name == "limits-moving" else FixedWindowRateLimiter
    limiter = limiter_cls(storage)
    item = RateLimitItemPerSecond(1_000_000_000)
    return lambda: limiter.hit(item, prefix, tenant)


async def _client(name: str, url: str, prefix: str, duration_s: float) -> int:
    op = await _make(name, url, prefix)
    for _ in range(50):  # warm up: script load, connection
        await op()
    done = 0
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        await op()
        done += 1
    return done


def _run_client(args: tuple[str, str, str, float]) -> int:
    return asyncio.run(_client(*args))


def measure(name: str, clients: int, url: str, duration_s: float) -> float:
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    ctx = mp.get_context("spawn")
    with ctx.Pool(clients) as pool:
        counts = pool.map(_run_client, [(name, url, prefix, duration_s)] * clients)
    return sum(counts) / duration_s


def redis_benchmark(url: str, clients: int, requests: int = 200_000) -> float | None:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    parsed = urlparse(url)
    import redis

    sha = redis.Redis.from_url(url).script_load(TRIVIAL)
    out = subprocess.run(
        [
            binary,
            "-h",
            parsed.hostname or "127.0.0.1",
            "-p",
            str(parsed.port or 6379),
            "-q",
            "-n",
            str(requests),
            "-c",
            str(clients),
            "EVALSHA",
            sha,
            "0",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    found = re.findall(r"([\d.]+) requests per second", out)
    return float(found[-1]) if found else None


def plot(results: dict[str, dict[str, float | None]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*LIMITERS, "redis-benchmark"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    for i, clients in enumerate(results):
        values = [results[clients].get(n) or 0 for n in names]
        ax.bar(
            [x + i * width for x in range(len(names))], values, width, label=f"{clients} client(s)"
        )
    ax.set_xticks([x + width / 2 for x in range(len(names))], names, rotation=15)
    ax.set_ylabel("decisions per second")
    ax.set_yscale("log")
    ax.set_title("Rate-limiter decisions per second on one Redis")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()

    results: dict[str, dict[str, float | None]] = {}
    for clients in args.clients:
        row: dict[str, float | None] = {}
        for name in LIMITERS:
            row[name] = measure(name, clients, args.redis_url, args.duration)
        row["redis-benchmark"] = redis_benchmark(args.redis_url, clients)
        results[str(clients)] = row

    print(f"{'clients':>7}  {'limiter':<16}{'ops/s':>10}  {'vs python-evalsha':>18}")
    for clients, row in results.items():
        base = row["python-evalsha"] or 1.0
        for name, value in row.items():
            shown = "n/a" if value is None else f"{value:10.0f}  {value / base:17.2f}x"
            print(f"{clients:>7}  {name:<16}{shown}")
    RESULTS.mkdir(exist_ok=True)
    doc = {
        "benchmark": "rate_limiter",
        "unit": "decisions per second",
        "baseline": "python-evalsha",
        "duration_s_per_measurement": args.duration,
        "machine": {
            "cpus": mp.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "results": results,
        "ratios_vs_baseline": {
            c: {
                n: (v / row["python-evalsha"] if v and row["python-evalsha"] else None)
                for n, v in row.items()
            }
            for c, row in results.items()
        },
    }
    (RESULTS / "rate_limiter.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, RESULTS / "rate_limiter.png")
    print(f"wrote {RESULTS / 'rate_limiter.json'} and {RESULTS / 'rate_limiter.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
