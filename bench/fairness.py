"""Does a VIP tenant keep its latency when many basic tenants use their whole quota
beside it? On the deployed path (issue 14): ``seawall up`` (its processes, the embedded
broker, the local Redis, simulated engines), driven through the SDK as a user would.

1. *Alone*: one enterprise tenant sends ``--vip-rate`` requests per second, open loop,
   for ``--duration`` seconds; nobody else sends anything.
2. *Loaded*: the same, while ``--basic`` basic tenants each run ``--loops`` closed loops
   (a request, its answer, the next request) at their quota: the SDK retries what their
   quota refuses after the ``Retry-After`` it is given, so each keeps its bucket empty.
3. *Alone again*: phase 1 once more, after the load has stopped.

The baseline is phases 1 and 3 of the same run, on the same stack, after ten unmeasured
VIP requests have warmed the path: the mean of their percentiles. The embedded broker
slows down as its topics fill, and deletes nothing; the loaded phase fills them most. A
baseline measured only before it would count the broker's drift as the load's cost;
the mean of one before and one after it is the baseline at the loaded phase's midpoint,
were the drift linear in time (the ratio to phase 1 alone is kept too).
Figures: the VIP's latency percentiles in each phase (terminal reply, not streamed, 16
tokens) and the loaded one's ratio to the baseline
(the goal: P99 loaded / alone at most 1.2), the VIP's failures, and what the basic
tenants got (answers per second, refusals seen by the SDK), and per phase the cores
each process used (the stack's services, the broker, this load generator) and the
machine's busy share — whether the machine itself was the bottleneck.

Writes ``results/fairness.json`` (``vip_p99_alone_ms``, ``vip_p99_loaded_ms``,
``vip_p99_loaded_over_alone`` against the two-sided baseline, and the details; until
2026-12-07 the baseline was phase 1 alone, ``vip_p99_loaded_over_alone_before``) and
``results/fairness.png``.
``--quick``: a shorter run, into a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from _common import commit, machine, midpoint, output_dir, ratio, summary

# `seawall up` and the call helpers come from the test support package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schemas import InferenceReply, ReplyStatus
from seawall_client import SeawallClient
from tests.chaos import Outcome, timed_calls
from tests.stack import Stack, launch

MAX_TOKENS = 16


def latencies_ms(results: list[Outcome]) -> list[float]:
    return [
        1000 * t
        for t, r in results
        if isinstance(r, InferenceReply) and r.status in (ReplyStatus.OK, ReplyStatus.DEGRADED)
    ]


def failures(results: list[Outcome]) -> int:
    return sum(
        1
        for _, r in results
        if not isinstance(r, InferenceReply)
        or r.status not in (ReplyStatus.OK, ReplyStatus.DEGRADED)
    )


async def closed_loop(
    client: SeawallClient, name: str, stop: asyncio.Event, tally: dict[str, int]
) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        try:
            reply = await client.complete(
                f"basic question {name}-{i}", max_tokens=MAX_TOKENS, timeout_s=60
            )
        except Exception:
            tally["errors"] += 1
            continue
        tally[reply.status.value] = tally.get(reply.status.value, 0) + 1


async def phase(
    stack: Stack, vip: SeawallClient, args: argparse.Namespace, loaded: bool, tag: str
) -> dict[str, Any]:
    stop = asyncio.Event()
    tally: dict[str, int] = {"errors": 0}
    clients: list[SeawallClient] = []
    loops: list[asyncio.Task[None]] = []
    if loaded:
        for b in range(args.basic):
            key = stack.key(f"fair-basic-{tag}-{b}", "basic")["key"]
            client = SeawallClient(api_key=key, kafka=stack.settings.kafka)
            await client.start()
            clients.append(client)
            for j in range(args.loops):
                loops.append(asyncio.create_task(closed_loop(client, f"{b}.{j}", stop, tally)))
        await asyncio.sleep(args.warmup)  # the basic tenants reach their quota first
    started = time.monotonic()
    cpu_before, machine_before = cpu_seconds(stack), psutil.cpu_times()
    n = int(args.vip_rate * args.duration)
    results = await timed_calls(vip, n, args.vip_rate, f"vip-{tag}", MAX_TOKENS)
    elapsed = time.monotonic() - started
    cpu_after, machine_after = cpu_seconds(stack), psutil.cpu_times()
    stop.set()
    for task in loops:
        task.cancel()
    for task in loops:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for client in clients:
        await client.stop()
    return {
        "vip_requests": n,
        "vip_failures": failures(results),
        "vip_latency_ms": summary(latencies_ms(results)),
        "basic_replies_by_status": {k: v for k, v in tally.items() if v},
        "basic_ok_per_s": tally.get("ok", 0) / elapsed if loaded else 0.0,
        "seconds": elapsed,
        "cpu_cores_used": {
            name: round((cpu_after[name] - cpu_before.get(name, 0.0)) / elapsed, 3)
            for name in sorted(cpu_after)
        },
        "machine_cpu_busy_share": round(busy_share(machine_before, machine_after), 3),
    }


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU seconds so far, per process: the stack's (by service instance, the broker and
    ``seawall up`` itself) and this one's (the load generator and its SDK clients)."""
    out = {"load generator (this process)": sum(psutil.Process().cpu_times()[:2])}
    root = psutil.Process(stack.proc.pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = proc.environ().get("SEAWALL_INSTANCE_ID") or proc.name()
            out[name] = out.get(name, 0.0) + sum(proc.cpu_times()[:2])
        except psutil.Error:
            continue
    return out


def busy_share(before: Any, after: Any) -> float:
    """The machine's CPU time not idle between two ``psutil.cpu_times()``."""
    total = sum(after) - sum(before)
    idle = (after.idle - before.idle) + (getattr(after, "iowait", 0) - getattr(before, "iowait", 0))
    return (total - idle) / total if total else 0.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--vip-rate", type=float, default=2.0)
    parser.add_argument("--basic", type=int, default=12, help="basic tenants")
    parser.add_argument("--loops", type=int, default=4, help="closed loops per basic tenant")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument(
        "--redis", default=os.environ.get("SEAWALL_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the stack on CPU 0, this load generator alone on CPU 1 (as taskset would)",
    )
    args = parser.parse_args()
    if args.quick:
        args.duration, args.warmup = 20.0, 5.0
    out = output_dir("fairness", args.quick)
    load_before = os.getloadavg()
    if args.pin:
        # Every process of the stack inherits this affinity when seawall up starts it;
        # the generator moves to the other core once the stack is up.
        os.sched_setaffinity(0, {0})
    with (
        tempfile.TemporaryDirectory(prefix="seawall-fairness-") as tmp,
        # the VIP shares the main pool with the abusers, as the figures were measured
        launch(Path(tmp), args.redis, "--enterprise-workers", "0") as stack,
    ):
        if args.pin:
            os.sched_setaffinity(0, {1})
        vip = SeawallClient(
            api_key=stack.key("fair-vip", "enterprise")["key"], kafka=stack.settings.kafka
        )
        await vip.start()
        try:
            # Warm: topics' metadata, consumer groups, connections (not measured).
            await timed_calls(vip, 10, 5.0, "vip-warm", MAX_TOKENS)
            before = await phase(stack, vip, args, loaded=False, tag="alone")
            loaded = await phase(stack, vip, args, loaded=True, tag="loaded")
            after = await phase(stack, vip, args, loaded=False, tag="after")
        finally:
            await vip.stop()
    alone = {
        q: midpoint(before["vip_latency_ms"][q], after["vip_latency_ms"][q]) for q in ("p50", "p99")
    }
    p99_alone = alone["p99"]
    p99_loaded = loaded["vip_latency_ms"]["p99"]
    doc = {
        "benchmark": "fairness",
        "path": (
            "seawall up: ingress, admission, workers (simulated engines), controller; "
            "embedded broker, local Redis; SDK clients"
        ),
        "settings": vars(args),
        "commit": commit(),
        "pinned": (
            "the stack (broker, services) on CPU 0, the load generator on CPU 1"
            if args.pin
            else "no pinning: the generator shares both cores with the stack"
        ),
        "vip_p99_alone_ms": p99_alone,
        "vip_p99_loaded_ms": p99_loaded,
        "vip_p99_loaded_over_alone": ratio(p99_loaded, p99_alone),
        "vip_p50_loaded_over_alone": ratio(loaded["vip_latency_ms"]["p50"], alone["p50"]),
        "vip_p99_loaded_over_alone_before": ratio(p99_loaded, before["vip_latency_ms"]["p99"]),
        "goal": "vip_p99_loaded_over_alone <= 1.2",
        "alone_latency_ms": alone,
        "alone": before,
        "loaded": loaded,
        "alone_after": after,
        "machine": machine(load_before),
    }
    (out / "fairness.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, out / "fairness.png")
    print(
        json.dumps(
            {
                k: doc[k]
                for k in (
                    "vip_p99_alone_ms",
                    "vip_p99_loaded_ms",
                    "vip_p99_loaded_over_alone",
                    "vip_p50_loaded_over_alone",
                    "vip_p99_loaded_over_alone_before",
                )
            },
            indent=2,
        )
    )
    basic = loaded["basic_replies_by_status"]
    print(f"basic tenants: {basic}, {loaded['basic_ok_per_s']:.1f} answers/s")
    print(f"wrote {out / 'fairness.json'} and {out / 'fairness.png'}")


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    marks = ("p50", "p99", "max")
    phases = (
        ("alone, before", doc["alone"]["vip_latency_ms"]),
        ("loaded", doc["loaded"]["vip_latency_ms"]),
        ("alone, after", doc["alone_after"]["vip_latency_ms"]),
    )
    for k, (name, lat) in enumerate(phases):
        ax.bar(
            [i + (k - 1) * 0.27 for i in range(len(marks))],
            [lat[m] or 0 for m in marks],
            width=0.27,
            label=f"VIP {name}",
        )
    ax.set_xticks(range(len(marks)), marks)
    ax.set_ylabel("VIP latency, ms (terminal reply)")
    ax.set_title(
        f"VIP alone vs beside {doc['settings']['basic']} basic tenants at quota:\n"
        f"p99 x{doc['vip_p99_loaded_over_alone'] or float('nan'):.2f} of both alone phases"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    asyncio.run(main())
