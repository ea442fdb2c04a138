"""What the quota pre-check at the edge saves under an abusive tenant (issue 15, item 5).

On the deployed path: ``seawall up`` (its processes, the embedded broker, the local
Redis, simulated engines), twice — with ingress's quota hints off
(``SEAWALL_QUOTA_HINT_TENANTS=0``: every request goes to admission, as before) and on
(the default). In each, for ``--duration`` seconds:

- an *abusive* basic tenant (20 requests, refilled at 1 a second) runs ``--loops``
  closed loops over plain HTTP that ignore ``Retry-After``: each sends its next request
  as soon as the last is answered;
- a *polite* enterprise tenant sends ``--polite-rate`` requests a second, open loop,
  through the SDK: its latency is what the flood must not cost.

Measured per run: the abusive tenant's answers by status and per second; how many of
its refusals ingress gave itself (``seawall_ingress_refusals_total{code=
"quota_exceeded"}``); the records that reached the priority topics (the broker's load
and admission's input; end offsets); the Redis commands processed (``INFO stats``, the
whole server: nothing else should use it during a run); the CPU each process used; the
polite tenant's latency percentiles. Figures are the "on" run as a ratio of the "off"
run (the baseline).

Writes ``results/abusive_tenant.json`` and ``results/abusive_tenant.png``; ``--quick``:
a shorter run, into a temporary directory.
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
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import redis
from _common import commit, machine, output_dir, ratio, summary
from aiokafka import TopicPartition
from fairness import cpu_seconds
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schemas import Priority
from seawall_client import SeawallClient
from services.common.bus import make_consumer, topics_of
from tests.chaos import timed_calls
from tests.stack import Stack, launch

MAX_TOKENS = 8


def edge_refusals(stack: Stack) -> float:
    text = httpx.get(stack.metrics_url("ingress"), timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "seawall_ingress_refusals_total" and s.labels.get("code") == "quota_exceeded"
    )


async def priority_records(stack: Stack) -> int:
    """Records on the priority topics so far (the sum of their end offsets)."""
    topics = topics_of(stack.settings)
    consumer = make_consumer(stack.settings, group_id=None)
    await consumer.start()
    try:
        await consumer.topics()
        tps = [
            TopicPartition(topics.requests(p), i)
            for p in Priority
            for i in sorted(consumer.partitions_for_topic(topics.requests(p)) or {0})
        ]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


async def abuse(url: str, key: str, loops: int, until: float) -> Counter[int]:
    statuses: Counter[int] = Counter()
    body = {"model": "default", "prompt": "again", "max_tokens": MAX_TOKENS}
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=loops)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as http:

        async def loop() -> None:
            while time.monotonic() < until:
                r = await http.post("/v1/completions", json=body)
                statuses[r.status_code] += 1

        await asyncio.gather(*(loop() for _ in range(loops)))
    return statuses


async def run(args: argparse.Namespace, hints: bool) -> dict[str, Any]:
    env = {} if hints else {"SEAWALL_QUOTA_HINT_TENANTS": "0"}
    r = redis.Redis.from_url(args.redis)
    with (
        tempfile.TemporaryDirectory(prefix="seawall-abuse-") as tmp,
        # the polite tenant shares the main pool with the abuser, as measured
        launch(Path(tmp), args.redis, "--enterprise-workers", "0", env=env) as stack,
    ):
        abuser = stack.key("abuser", "basic")["key"]
        polite = SeawallClient(
            api_key=stack.key("polite", "enterprise")["key"], kafka=stack.settings.kafka
        )
        await polite.start()
        try:
            await timed_calls(polite, 5, 5.0, "warm", MAX_TOKENS)  # not measured
            records0, refusals0 = await priority_records(stack), edge_refusals(stack)
            commands0 = int(r.info("stats")["total_commands_processed"])
            cpu0, started = cpu_seconds(stack), time.monotonic()
            n_polite = int(args.duration * args.polite_rate)
            statuses, outcomes = await asyncio.gather(
                abuse(stack.url, abuser, args.loops, started + args.duration),
                timed_calls(polite, n_polite, args.polite_rate, "polite", MAX_TOKENS),
            )
            elapsed = time.monotonic() - started
            cpu1 = cpu_seconds(stack)
            commands = int(r.info("stats")["total_commands_processed"]) - commands0
            records = await priority_records(stack) - records0
            refused_at_edge = edge_refusals(stack) - refusals0
        finally:
            await polite.stop()
    latencies = [t * 1000 for t, o in outcomes if not isinstance(o, BaseException)]
    answered = sum(statuses.values())
    return {
        "hints": hints,
        "seconds": elapsed,
        "abusive_by_status": {str(k): v for k, v in sorted(statuses.items())},
        "abusive_answers_per_s": answered / elapsed,
        "refused_at_edge": refused_at_edge,
        "refused_at_edge_share": refused_at_edge / answered if answered else 0.0,
        "priority_records": records,
        "priority_records_per_s": records / elapsed,
        "redis_commands_per_s": commands / elapsed,
        "cpu_cores_used": {
            k: round((cpu1[k] - cpu0.get(k, 0.0)) / elapsed, 3) for k in sorted(cpu1)
        },
        "polite_latency_ms": summary(latencies),
        "polite_failures": sum(
            1
            for _, o in outcomes
            if isinstance(o, BaseException) or o.status.value not in ("ok", "degraded")
        ),
    }


def core(run: dict[str, Any], name: str) -> float:
    return float(sum(v for k, v in run["cpu_cores_used"].items() if name in k))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--loops", type=int, default=16)
    parser.add_argument("--polite-rate", type=float, default=2.0)
    parser.add_argument(
        "--redis", default=os.environ.get("SEAWALL_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    args = parser.parse_args()
    if args.quick:
        args.duration = 10.0
    out = output_dir("abusive_tenant", args.quick)
    load_before = os.getloadavg()
    off = await run(args, hints=False)
    on = await run(args, hints=True)
    doc = {
        "benchmark": "abusive_tenant",
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": vars(args),
        "baseline": "the same run with ingress's quota hints off",
        "off": off,
        "on": on,
        **{
            f"{name}_on_over_off": ratio(of(on), of(off))
            for name, of in (
                ("priority_records", lambda r: r["priority_records_per_s"]),
                ("redis_commands", lambda r: r["redis_commands_per_s"]),
                ("admission_cpu", lambda r: core(r, "admission")),
                ("broker_cpu", lambda r: core(r, "tansu")),
                ("abusive_answers", lambda r: r["abusive_answers_per_s"]),
                ("polite_p99", lambda r: r["polite_latency_ms"]["p99"]),
            )
        },
        "machine": machine(load_before),
    }
    (out / "abusive_tenant.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, out / "abusive_tenant.png")
    for key in (k for k in doc if k.endswith("_on_over_off")):
        print(f"{key:34} {doc[key]:.3f}" if doc[key] is not None else f"{key:34} -")
    for r in (off, on):
        print(
            f"hints {'on ' if r['hints'] else 'off'}: {r['abusive_answers_per_s']:.0f} answers/s "
            f"{r['abusive_by_status']}, {r['refused_at_edge_share']:.0%} refused at the edge, "
            f"{r['priority_records_per_s']:.0f} records/s to admission, "
            f"{r['redis_commands_per_s']:.0f} Redis commands/s, polite p99 "
            f"{r['polite_latency_ms']['p99']:.0f} ms, cores {r['cpu_cores_used']}"
        )
    print(f"wrote {out / 'abusive_tenant.json'} and {out / 'abusive_tenant.png'}")


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = (doc["off"], doc["on"])
    labels = ["hints off (baseline)", "hints on"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (
        ("records to admission /s", [r["priority_records_per_s"] for r in runs]),
        ("Redis commands /s", [r["redis_commands_per_s"] for r in runs]),
        ("admission cores", [core(r, "admission") for r in runs]),
    )
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(labels, values, color=["0.6", "tab:blue"])
        ax.set_title(title)
    fig.suptitle(
        f"an abusive basic tenant, {doc['settings']['loops']} closed loops ignoring Retry-After"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
