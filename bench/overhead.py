"""What seawall costs every request (issue 38): the time to first token it adds and the
CPU it burns, next to the same requests sent straight to the engine.

Two arms on the same machine, the same simulated engine profile (a Llama-2-7B on an
A100, ``seawall sim-serve``'s and the dedicated worker's default), the same client:

- *direct*: ``seawall sim-serve``, the engine behind an OpenAI-compatible server of its
  own, no control plane — what a user without seawall would run;
- *seawall*: ``seawall up`` (every service its own process, the embedded broker, the
  local Redis), an enterprise key, so its requests go to the dedicated worker.

At each rate (5, 40 and 200 requests/s by default), open-loop Poisson arrivals of the
same streamed chat request (16 tokens) through the official ``openai`` SDK, first to
the direct arm, then through seawall. Per rate: TTFT p50/p99 both ways and their
difference, CPU-ms per request of every process (from ``/proc``, through psutil: each
service, the broker, Redis, the engine server, this load generator), above the
process's idle rate measured first, the Kafka records each request cost, per topic; and
the stage breakdown from the services' traces (every seawall request carries a
``traceparent`` of its own). Before any load: the cores each process uses idle over
``--idle`` seconds.

Writes ``results/overhead.json`` — ``rates`` (each with ``rate``, ``direct_ttft_ms``,
``seawall_ttft_ms`` and ``added_ttft_ms`` as ``{"p50", "p99"}``, ``cpu_ms_per_request``
with a ``total``), ``idle_cores`` with a ``total``, ``stages_ms`` per rate, and the
commit it ran on — and ``results/overhead.png``. ``--quick``: short phases, into a
temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil
from _common import commit, machine, output_dir, summary

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from aiokafka import AIOKafkaConsumer
from openai import AsyncOpenAI

from seawall.embedded import free_port
from seawall.traces import stage_quantiles, stage_table, traces_in
from seawall_client.tracecontext import new_trace
from services.common.screening import WORKER_SUFFIX
from services.common.tracing import FLUSH_INTERVAL_S
from tests.stack import Stack, clean_env, launch

MAX_TOKENS = 16
PROMPT = "Write a haiku about the sea"
RATES = (5.0, 40.0, 200.0)
SECONDS = {5.0: 40.0, 40.0: 20.0, 200.0: 10.0}
"""Seconds of arrivals at each rate: 200 requests at 5/s, 800 at 40/s, 2,000 at 200/s."""
WARMUP = 10
DIRECT_MODEL = "sim-llama-2-7b"


# -- processes and their CPU --------------------------------------------------------------
def redis_process(port: int) -> psutil.Process | None:
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if ("redis-server" in cmd or "valkey-server" in cmd) and f":{port}" in cmd:
                return proc
        except psutil.Error:
            continue
    return None


def stack_processes(stack: Stack) -> dict[str, psutil.Process]:
    """Every process of the stack by name: its services (by instance id), the broker."""
    out: dict[str, psutil.Process] = {}
    for child in psutil.Process(stack.proc.pid).children(recursive=True):
        try:
            instance = child.environ().get("SEAWALL_INSTANCE_ID")
            if instance and not instance.endswith(WORKER_SUFFIX):  # counted with its owner
                out[instance] = child
            elif "tansu" in " ".join(child.cmdline()):
                out["broker"] = child
        except psutil.Error:
            continue
    return out


def cpu_seconds(procs: Mapping[str, psutil.Process]) -> dict[str, float]:
    """Each process's CPU seconds, its screening workers' included (ingress's long
    prompts are screened there: its cost all the same)."""
    out: dict[str, float] = {}
    for name, proc in procs.items():
        try:
            total = 0.0
            for p in (proc, *screening_workers(proc)):
                with contextlib.suppress(psutil.NoSuchProcess):
                    t = p.cpu_times()
                    total += t.user + t.system
            out[name] = total
        except psutil.Error:
            out[name] = float("nan")
    return out


def screening_workers(proc: psutil.Process) -> list[psutil.Process]:
    """``proc``'s screening workers (``services.common.screening``: its children whose
    instance id ends in ``WORKER_SUFFIX``)."""
    out = []
    for child in proc.children():
        with contextlib.suppress(psutil.Error):
            if child.environ().get("SEAWALL_INSTANCE_ID", "").endswith(WORKER_SUFFIX):
                out.append(child)
    return out


@contextlib.contextmanager
def cpu_window(procs: Mapping[str, psutil.Process]) -> Iterator[dict[str, float]]:
    """The CPU seconds each process used inside the block (filled in when it ends), and
    ``_elapsed_s``."""
    result: dict[str, float] = {}
    before, t0 = cpu_seconds(procs), time.monotonic()
    yield result
    after, t1 = cpu_seconds(procs), time.monotonic()
    result.update({name: after[name] - before[name] for name in procs})
    result["_elapsed_s"] = t1 - t0


# -- records a request costs ---------------------------------------------------------------
async def end_offsets(bootstrap: str, prefix: str) -> dict[str, int]:
    """Per topic of the stack, the records it holds (the sum of its partitions' ends)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await consumer.start()
    try:
        topics = [t for t in await consumer.topics() if t.startswith(prefix)]
        from aiokafka import TopicPartition

        tps = [TopicPartition(t, p) for t in topics for p in consumer.partitions_for_topic(t) or ()]
        ends = await consumer.end_offsets(tps) if tps else {}
        out: dict[str, int] = {}
        for tp, end in ends.items():
            name = tp.topic[len(prefix) :]
            name = "llm.reply.*" if name.startswith("llm.reply.") else name
            out[name] = out.get(name, 0) + end
        return out
    finally:
        await consumer.stop()


# -- the load --------------------------------------------------------------------------
Result = tuple[float | None, list[float], str, str]
"""A streamed request's TTFT in ms (``None``: it failed), the gaps between the pieces
of text it got after the first (ms), what went wrong, its trace id."""


async def one(client: AsyncOpenAI, model: str, traced: bool) -> Result:
    trace = new_trace()
    headers = {"traceparent": trace.header} if traced else {}
    t0 = time.perf_counter()
    texts: list[float] = []
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_headers=headers,
        )
        async for event in stream:
            if event.choices and event.choices[0].delta.content:
                texts.append(time.perf_counter())
    except Exception as e:  # a failure is this request's outcome, counted
        return None, [], type(e).__name__, trace.trace_id
    if not texts:
        return None, [], "no text", trace.trace_id
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(texts)]
    return (texts[0] - t0) * 1000, gaps, "", trace.trace_id


async def open_loop(
    url: str, key: str, model: str, rate: float, seconds: float, seed: int, traced: bool
) -> list[Result]:
    """Poisson arrivals at ``rate`` for ``seconds``; each request's result."""
    rng = random.Random(seed)
    client = AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
    async with client:
        for _ in range(WARMUP):
            await one(client, model, traced=False)
        tasks = []
        start = time.perf_counter()
        at = 0.0
        while at < seconds:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, model, traced)))
            at += rng.expovariate(rate)
        return await asyncio.gather(*tasks)


def quantiles(values: Sequence[float]) -> dict[str, float | None]:
    s = summary(list(values))
    return {"p50": s["p50"], "p99": s["p99"]}


def per_request_ms(
    cpu: Mapping[str, float], idle: Mapping[str, float], requests: int
) -> dict[str, float]:
    """CPU-ms per request of each process above its idle rate, and their ``total``."""
    elapsed = cpu["_elapsed_s"]
    out = {
        name: round(max(0.0, used - idle.get(name, 0.0) * elapsed) * 1000 / requests, 2)
        for name, used in cpu.items()
        if not name.startswith("_")
    }
    out["total"] = round(sum(out.values()), 2)
    return out


REFUSALS = 3000
"""Requests of each kind of refusal (8 at a time, keep-alive)."""


async def post_all(client: httpx.AsyncClient, request: dict[str, Any], n: int) -> Counter[int]:
    """``n`` posts of ``request``, 8 at a time; the statuses they got."""
    gate = asyncio.Semaphore(8)
    statuses: Counter[int] = Counter()

    async def one() -> None:
        async with gate:
            response = await client.post("/v1/chat/completions", **request)
            statuses[response.status_code] += 1

    await asyncio.gather(*(one() for _ in range(n)))
    return statuses


async def refusals(
    stack: Stack, procs: Mapping[str, psutil.Process], idle: Mapping[str, float]
) -> dict[str, Any]:
    """What a refusal at the edge costs: CPU-ms per refused request of each process,
    above its idle rate, for a bad key, a body over the size limit and a tenant over
    its quota (basic: a bucket of 20; admission's hint refuses the rest at the edge
    until the bucket refills)."""
    flood = stack.key("overhead-flood", "basic")["key"]
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    kinds: dict[str, dict[str, Any]] = {
        "bad_key": {
            "headers": {"Authorization": "Bearer sk-sw-000000000000_" + "x" * 43},
            "json": body,
        },
        "body_too_large": {
            "headers": {"Authorization": f"Bearer {flood}"},
            "content": b"x" * 20_000,
        },
        "over_quota": {"headers": {"Authorization": f"Bearer {flood}"}, "json": body},
    }
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        for kind, request in kinds.items():
            await post_all(client, request, 50)  # warm; the quota hint issued
            with cpu_window(procs) as cpu:
                statuses = await post_all(client, request, REFUSALS)
            per = per_request_ms({k: v for k, v in cpu.items() if k != DIRECT}, idle, REFUSALS)
            per.pop(GENERATOR, None)
            per["total"] = round(sum(v for k, v in per.items() if k != "total"), 3)
            out[kind] = {
                "statuses": {str(k): v for k, v in sorted(statuses.items())},
                "per_second": round(REFUSALS / cpu["_elapsed_s"]),
                "cpu_ms_per_refusal": per,
            }
            print(
                f"refusal {kind}: {out[kind]['statuses']}, ingress {per.get('ingress')} ms "
                f"CPU a refusal, all processes {per['total']} ms"
            )
    return out


DIRECT = "sim-serve (direct arm)"
GENERATOR = "load generator"


async def measure_rate(
    rate: float,
    args: argparse.Namespace,
    stack: Stack,
    key: str,
    sim_port: int,
    procs: Mapping[str, psutil.Process],
    idle: Mapping[str, float],
) -> dict[str, Any]:
    """One rate: the direct arm, then the same arrivals through seawall."""
    seconds = SECONDS.get(rate, 20.0) * args.scale
    bootstrap, prefix = stack.settings.kafka_bootstrap, stack.settings.topic_prefix
    with cpu_window(procs) as direct_cpu:
        direct = await open_loop(
            f"http://127.0.0.1:{sim_port}/v1", "none", DIRECT_MODEL, rate, seconds, args.seed, False
        )
    before = await end_offsets(bootstrap, prefix)
    with cpu_window(procs) as sw_cpu:
        through = await open_loop(f"{stack.url}/v1", key, "default", rate, seconds, args.seed, True)
    d_ttft = [t for t, _, _, _ in direct if t is not None]
    d_err = [e for t, _, e, _ in direct if t is None]
    s_ttft = [t for t, _, _, _ in through if t is not None]
    s_err = [e for t, _, e, _ in through if t is None]
    trace_ids = [tid for *_, tid in through]
    after = await end_offsets(bootstrap, prefix)
    await asyncio.sleep(FLUSH_INTERVAL_S + 1.0)  # the services' last spans
    trace_dir = Path(stack.settings.trace_dir or "")
    stages = stage_quantiles(traces_in(trace_dir, set(trace_ids)).values())
    n_direct = len(d_ttft) + len(d_err) + WARMUP
    n_sw = len(s_ttft) + len(s_err) + WARMUP
    direct_q, sw_q = quantiles(d_ttft), quantiles(s_ttft)
    added = {
        k: None if direct_q[k] is None or sw_q[k] is None else sw_q[k] - direct_q[k]  # type: ignore[operator]
        for k in ("p50", "p99")
    }
    records: dict[str, float] = {
        t: round((after.get(t, 0) - before.get(t, 0)) / n_sw, 2)
        for t in sorted(after)
        if after.get(t, 0) != before.get(t, 0)
    }
    records["total"] = round(sum(records.values()), 2)
    cpu_sw = per_request_ms({k: v for k, v in sw_cpu.items() if k != DIRECT}, idle, n_sw)
    generator_sw = cpu_sw.pop(GENERATOR, None)
    cpu_sw["total"] = round(sum(v for k, v in cpu_sw.items() if k != "total"), 2)
    direct_keys = (DIRECT, GENERATOR, "_elapsed_s")
    cpu_direct = per_request_ms({k: direct_cpu[k] for k in direct_keys}, idle, n_direct)
    row = {
        "rate": rate,
        "seconds": seconds,
        "requests": {"direct": len(d_ttft) + len(d_err), "seawall": len(s_ttft) + len(s_err)},
        "errors": {
            "direct": len(d_err),
            "seawall": len(s_err),
            "kinds": sorted(set(d_err) | set(s_err)),
        },
        "direct_ttft_ms": direct_q,
        "seawall_ttft_ms": sw_q,
        "added_ttft_ms": added,
        # What the client sees between two pieces of text after the first: the engine
        # gives a token every ~11 ms; seawall coalesces (SEAWALL_CHUNK_MAX_*).
        "inter_chunk_gap_ms": {
            "direct": quantiles([g for _, gaps, _, _ in direct for g in gaps]),
            "seawall": quantiles([g for _, gaps, _, _ in through for g in gaps]),
        },
        "text_pieces_per_request": {
            "direct": round(sum(len(g) + 1 for t, g, _, _ in direct if t) / max(1, len(d_ttft)), 2),
            "seawall": round(
                sum(len(g) + 1 for t, g, _, _ in through if t) / max(1, len(s_ttft)), 2
            ),
        },
        "cpu_ms_per_request": cpu_sw,
        "load_generator_cpu_ms_per_request": {
            "direct": cpu_direct.get(GENERATOR),
            "seawall": generator_sw,
        },
        "direct_engine_server_cpu_ms_per_request": cpu_direct.get(DIRECT),
        "kafka_records_per_request": records,
        "stages_ms": stages,
    }
    print(
        f"{rate:>6.0f}/s  TTFT p50 {fmt(direct_q['p50'])} -> {fmt(sw_q['p50'])} "
        f"(+{fmt(added['p50'])}), p99 {fmt(direct_q['p99'])} -> {fmt(sw_q['p99'])} "
        f"(+{fmt(added['p99'])}) ms; CPU {cpu_sw['total']} ms a request; "
        f"{records['total']} records a request; errors {len(d_err)}/{len(s_err)}"
    )
    for line in stage_table(stages):
        print("    " + line)
    return row


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="seawall-overhead-"))
    redis = redis_process(args.redis_port)
    sim_port = free_port()
    sim = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "seawall.cli",
        "sim-serve",
        "--port",
        str(sim_port),
        env=clean_env(),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        env = dict(pair.split("=", 1) for pair in args.env)
        redis_url = f"redis://127.0.0.1:{args.redis_port}/0"
        with launch(work / "state", redis_url, env=env) as stack:
            key = stack.key("overhead-co", "enterprise")["key"]
            # The tier's quota is not what is measured here: room for 200 requests/s.
            stack.cli(
                "quota",
                "set",
                "--tenant",
                "overhead-co",
                "--rps",
                "5000",
                "--tpm",
                "1000000000",
                "--ttl",
                "3600",
                "--reason",
                "bench/overhead.py",
            )
            procs = stack_processes(stack)
            if redis is not None:
                procs["redis"] = redis
            procs[DIRECT] = psutil.Process(sim.pid)
            procs[GENERATOR] = psutil.Process()
            await asyncio.sleep(args.settle)  # joins, first reports, first decisions
            with cpu_window(procs) as idle_cpu:
                await asyncio.sleep(args.idle)
            idle = {n: idle_cpu[n] / idle_cpu["_elapsed_s"] for n in procs}
            idle_cores = {n: round(v, 3) for n, v in idle.items()}
            stack_names = [n for n in procs if n not in (GENERATOR, DIRECT)]
            idle_cores["total"] = round(sum(idle[n] for n in stack_names), 3)
            print(f"idle cores: {json.dumps(idle_cores)}")
            rates = [
                await measure_rate(rate, args, stack, key, sim_port, procs, idle)
                for rate in args.rates
            ]
            refused = await refusals(stack, procs, idle)
    finally:
        sim.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sim.wait(), 10)
    return {
        "benchmark": "overhead",
        "commit": commit(),
        "broker": "embedded (Tansu, memory storage)",
        "max_tokens": MAX_TOKENS,
        "idle_cores": idle_cores,
        "idle_seconds": args.idle,
        "stack_env": dict(pair.split("=", 1) for pair in args.env),
        "rates": rates,
        "stages_ms": {str(r["rate"]): r["stages_ms"] for r in rates},
        "refusals": refused,
        "machine": machine(LOADAVG),
    }


def fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def plot(doc: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rates"]
    labels = [f"{r['rate']:g}/s" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(rows))
    for i, (arm, key) in enumerate((("direct", "direct_ttft_ms"), ("seawall", "seawall_ttft_ms"))):
        p50 = [r[key]["p50"] or 0 for r in rows]
        p99 = [r[key]["p99"] or 0 for r in rows]
        xs = [j + (i - 0.5) * 0.35 for j in x]
        ax1.bar(xs, p99, 0.35, alpha=0.35, color=f"C{i}")
        ax1.bar(xs, p50, 0.35, label=f"{arm} (p50 solid, p99 light)", color=f"C{i}")
    for j, r in enumerate(rows):
        added = r["added_ttft_ms"]["p50"]
        if added is not None:
            ax1.annotate(
                f"+{added:.0f} ms",
                (j + 0.17, r["seawall_ttft_ms"]["p50"] or 1),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax1.set_yscale("log")
    ax1.set_xticks(list(x), labels)
    ax1.set_ylabel("TTFT (ms, log scale)")
    ax1.set_title("time to first token, direct vs through seawall (added p50 marked)")
    ax1.legend(fontsize=8)
    names = sorted({n for r in rows for n in r["cpu_ms_per_request"] if n != "total"})
    bottom = [0.0] * len(rows)
    for j, name in enumerate(names):
        vals = [r["cpu_ms_per_request"].get(name, 0.0) for r in rows]
        ax2.bar(list(x), vals, 0.6, bottom=bottom, label=name, color=f"C{j % 10}")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax2.set_xticks(list(x), labels)
    ax2.set_ylabel("CPU ms per request, above idle")
    ax2.set_title(f"seawall's CPU a request (idle: {doc['idle_cores']['total']} cores)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


LOADAVG = os.getloadavg()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    parser.add_argument("--scale", type=float, default=1.0, help="Multiplies each phase's seconds.")
    parser.add_argument("--idle", type=float, default=30.0, help="Seconds of idle measured.")
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--redis-port", type=int, default=6379)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        help="NAME=VALUE for every service of the stack (repeatable), e.g. "
        "SEAWALL_CHUNK_MAX_INTERVAL_S=0.25",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--replot", type=Path, help="only draw the plot of this results JSON, beside it"
    )
    args = parser.parse_args()
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    if args.quick:
        args.scale, args.idle, args.settle = 0.25, 5.0, 8.0
    doc = asyncio.run(run(args))
    out = output_dir("overhead", args.quick)
    (out / "overhead.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, out / "overhead.png")
    print(f"written: {out / 'overhead.json'}, {out / 'overhead.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
