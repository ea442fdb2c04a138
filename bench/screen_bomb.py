"""Screen bombs (security issue 40, item 3): what a prompt built to make the
sensitive-data screen (``services.common.sensitive``) work hardest costs ingress, and
what it does to another tenant's latency. The goal: at most 5 ms of ingress CPU a bomb,
and the other tenant's p99 within 1.2× of its p99 without bombs.

One ingress process (``python -m services.ingress``, HTTP only) on the embedded broker
and the local Redis; this process plays the clients and the rest of the fleet (it reads
the priority topics and answers each request on its reply topic at once, so a request's
latency is ingress's work and its broker hops). Two tenants, two keys:

- *steady*: short chat requests at a fixed rate (``--rate``, 20/s), the same arrivals in
  every phase; their latency is the time to the HTTP response;
- *bomber*: bombs at a fixed rate (``--bomb-rate``, 20/s), each as large as the body
  limit takes (16 KiB). The kinds (``BOMBS``): ``flood``, ``"pwd:x "`` repeated (2,666
  findings: refused ``too_much_sensitive_data`` once 33 are found, before any
  redaction); and the worst cases found for the screen's scans, which find nothing and
  so are scanned to the end and forwarded: ``resident_ids`` (18-digit numbers with a
  real province code and date of birth and a wrong check character: each one matched
  and checked), ``order_cards`` (Luhn-valid card numbers after an order word: each one
  matched, Luhn-checked, its context searched), ``bare_labels`` (``"pwd:、"``: a
  credential label whose value never starts).

Phases, on the same ingress, after a warm-up: steady alone; steady beside two of the
kinds, one after the other; beside a mix of every kind in turn (the headline); beside
the other two kinds, then beside plain 16 KiB prompts at the bomb rate (``PLAIN``:
what any request that large costs); steady alone again (garbage collection off in this process
meanwhile, ``steady_clock_hand``). Ingress's CPU (user +
system, ``/proc/<pid>/stat`` through psutil, its screening worker processes included)
over each phase, less the mean of the two
alone phases (the same steady load), over the bombs sent: CPU a bomb. The steady
tenant's p50/p99 beside the mix against the mean of the two alone phases. Then, off the
record, ``py-spy`` samples ingress for ``--profile-s`` seconds beside the costliest kind:
where its time goes. Beside each kind, the screen alone (``screen()`` on the same text
in this process, best of 20) and the prompt's token count (``count_tokens``, which
ingress runs on every prompt before screening it).

Writes ``results/screen_bomb.json`` (``bomb_cpu_ms_per_request``,
``other_latency_p50_ms`` / ``other_latency_p99_ms`` as ``{"alone", "beside_bombs"}``,
``other_latency_p99_ratio``, per kind in ``bombs``, the profile, the commit) and
``results/screen_bomb.png``; ``--quick``: short phases, into a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from _common import (
    commit,
    control_keys,
    embedded_broker,
    machine,
    midpoint,
    output_dir,
    ratio,
    steady_clock_hand,
    summary,
)

from schemas import InferenceReply, Priority, ReplyStatus, Tier
from seawall.embedded import free_port
from seawall_client.kafka import ensure_topics, start_tail
from seawall_client.serde import REQUEST, decode, encode
from seawall_client.topics import RedisKeys
from services.common.bus import make_consumer, make_producer, topics_of
from services.common.redisclient import make_redis
from services.common.sensitive import gb11643_check_char, luhn_check_digit, screen
from services.common.tokenizer import count_tokens
from services.ingress.keystore import AuditLog, KeyStore
from services.ingress.settings import IngressSettings

PEPPER = "bench-screen-bomb-pepper-0123456789"
MAX_BODY_BYTES = 16 * 1024
"""Ingress's body limit (``max_request_bytes``' default): a bomb fills it."""
GOAL_CPU_MS = 5.0
GOAL_P99_RATIO = 1.2
STEADY_PROMPT = "What is the capital of France? Answer in one word."


def _card() -> str:
    payload = "411111111111111"
    return payload + luhn_check_digit(payload)


def _bad_resident_id() -> str:
    first17 = "11010119900307123"  # Beijing, born 1990-03-07
    good = gb11643_check_char(first17)
    return first17 + ("0" if good != "0" else "1")


BOMBS: dict[str, str] = {
    "flood": "pwd:x ",
    "resident_ids": _bad_resident_id() + " ",
    "order_cards": f"order {_card()} ",
    "bare_labels": "pwd:、",
}
"""Each kind's repeated unit (module notes)."""
PLAIN = "plain"
PLAIN_UNIT = "The quick brown fox jumps over the lazy dog. "
"""Not a bomb: a prompt of plain English as large, sent like a bomb in a phase of its
own, for what any 16 KiB request costs ingress (parsing, counting tokens, publishing,
the reply) beside what a bomb adds."""


def body(prompt: str) -> bytes:
    return json.dumps(
        {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8},
        ensure_ascii=False,
    ).encode()


def bomb_prompt(unit: str) -> str:
    """``unit`` repeated as often as a body within the limit holds."""
    room = MAX_BODY_BYTES - len(body(""))
    return unit * (room // len(unit.encode()))


def screen_cost(prompt: str) -> dict[str, Any]:
    """The screen alone on ``prompt`` in this process (best of 20), what it decided, and
    the prompt's tokens (counted by ingress before the screen)."""
    best = best_tokens = float("inf")
    for _ in range(20):
        started = time.perf_counter()
        screening = screen(prompt, "redact")
        best = min(best, time.perf_counter() - started)
    for _ in range(5):
        started = time.perf_counter()
        count_tokens(prompt)
        best_tokens = min(best_tokens, time.perf_counter() - started)
    return {
        "screen_ms": best * 1000,
        "count_tokens_ms": best_tokens * 1000,
        "findings": len(screening.findings),
        "refused": screening.flooded,
        "body_bytes": len(body(prompt)),
    }


# -- the fleet beyond ingress ------------------------------------------------------------
async def answer_everything(settings: IngressSettings, ready: asyncio.Event) -> None:
    """Plays admission and the workers: each request on a priority topic is answered at
    once on its reply topic."""
    topics = topics_of(settings)
    consumer = make_consumer(settings, group_id=None)
    producer = make_producer(settings)
    await producer.start()
    try:
        await start_tail(consumer, *(topics.requests(p) for p in Priority))
        ready.set()
        while True:
            for records in (await consumer.getmany(timeout_ms=100)).values():
                for record in records:
                    request = decode(REQUEST, record.value)
                    reply = InferenceReply(
                        request_id=request.request_id,
                        status=ReplyStatus.OK,
                        text="Paris",
                        prompt_tokens=request.prompt_tokens or 1,
                        completion_tokens=1,
                        finish_reason="stop",
                        completed_at=time.time(),
                    )
                    await producer.send(
                        request.reply_to, encode(reply), key=request.request_id.encode()
                    )
    finally:
        await consumer.stop()
        await producer.stop()


# -- load ----------------------------------------------------------------------------------
async def fixed_rate(
    client: httpx.AsyncClient,
    key: str,
    rate: float,
    duration_s: float,
    make_body: Callable[[int], bytes],
) -> tuple[list[float], Counter[str]]:
    """Request ``i`` at ``i / rate`` seconds from now, each on its own, whatever became of
    the others (open loop): the latencies of those answered 200, and every outcome."""
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    latencies: list[float] = []
    outcomes: Counter[str] = Counter()
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(i: int) -> None:
        payload = make_body(i)
        sent = loop.time()
        try:
            response = await client.post("/v1/chat/completions", content=payload, headers=headers)
        except httpx.HTTPError as e:
            outcomes[type(e).__name__] += 1
            return
        took = loop.time() - sent
        if response.status_code == 200:
            latencies.append(took)
            outcomes["200"] += 1
        else:
            code = response.json().get("error", {}).get("code")
            outcomes[f"{response.status_code} {code}"] += 1

    tasks = []
    for i in range(int(rate * duration_s)):
        await asyncio.sleep(max(0.0, start + i / rate - loop.time()))
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return latencies, outcomes


def cpu_s(proc: psutil.Process) -> float:
    """Ingress's CPU and its screening workers' (``services.common.screening``: long
    prompts are screened there, so their cost is ingress's all the same)."""
    total = 0.0
    for p in (proc, *proc.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = p.cpu_times()
            total += times.user + times.system
    return total


async def phase(
    client: httpx.AsyncClient,
    ingress: psutil.Process,
    keys: dict[str, str],
    args: argparse.Namespace,
    duration_s: float,
    kinds: list[str],
    prompts: dict[str, str],
) -> dict[str, Any]:
    """The steady tenant's load, beside bombs of ``kinds`` in turn (none: alone)."""
    await asyncio.sleep(1.0)  # what the last phase left in flight is done
    steady_body = body(STEADY_PROMPT)
    bomb_bodies = [body(prompts[k]) for k in kinds]
    cpu_before = cpu_s(ingress)
    started = time.monotonic()
    steady = fixed_rate(client, keys["steady"], args.rate, duration_s, lambda i: steady_body)
    if kinds:
        bombs = fixed_rate(
            client,
            keys["bomber"],
            args.bomb_rate,
            duration_s,
            lambda i: bomb_bodies[i % len(bomb_bodies)],
        )
        (latencies, outcomes), (_, bomb_outcomes) = await asyncio.gather(steady, bombs)
    else:
        latencies, outcomes = await steady
        bomb_outcomes = Counter()
    return {
        "kinds": kinds,
        "duration_s": duration_s,
        "wall_s": time.monotonic() - started,
        "ingress_cpu_s": cpu_s(ingress) - cpu_before,
        "steady_latency_s": summary(latencies),
        "steady_outcomes": dict(outcomes),
        "bombs_sent": sum(bomb_outcomes.values()),
        "bomb_outcomes": dict(bomb_outcomes),
    }


def per_bomb_ms(run: dict[str, Any], alone_cpu_s: float) -> float | None:
    sent: int = run["bombs_sent"]
    spent: float = run["ingress_cpu_s"]
    return None if not sent else (spent - alone_cpu_s) / sent * 1000


# -- ingress, its keys, its profile ----------------------------------------------------------
def ingress_env(bootstrap: str, redis_url: str, tag: str, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEAWALL_")}
    env.update(
        SEAWALL_ENV_FILE=os.devnull,
        SEAWALL_KAFKA_BOOTSTRAP=bootstrap,
        SEAWALL_KAFKA_IDEMPOTENCE="false",
        SEAWALL_REDIS_URL=redis_url,
        SEAWALL_TOPIC_PREFIX=f"bomb{tag}.",
        SEAWALL_REDIS_PREFIX=f"bench:bomb:{tag}:",
        SEAWALL_INSTANCE_ID=f"bomb-{tag}",
        SEAWALL_INGRESS_PORT=str(port),
        SEAWALL_KEY_PEPPER=PEPPER,
        SEAWALL_KAFKA_INGRESS="false",
        SEAWALL_CONTROL_KEYS_DIR=str(control_keys()),
        SEAWALL_LOG_LEVEL="WARNING",
    )
    return env


def spawn_ingress(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services.ingress"], env=env, stdout=out, stderr=out
        )


@contextlib.asynccontextmanager
async def ingress_process(env: dict[str, str], log: Path) -> AsyncIterator[psutil.Process]:
    proc = spawn_ingress(env, log)
    try:
        url = f"http://127.0.0.1:{env['SEAWALL_INGRESS_PORT']}/health"
        async with httpx.AsyncClient() as probe:
            for _ in range(600):
                if proc.poll() is not None:
                    raise RuntimeError(f"ingress exited; see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await probe.get(url, timeout=1)).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"ingress did not become ready; see {log}")
        yield psutil.Process(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def make_keys(settings: IngressSettings) -> dict[str, str]:
    topics = topics_of(settings)
    await ensure_topics(settings.kafka, topics.specs())
    redis = make_redis(settings)
    producer = make_producer(settings)
    await producer.start()
    try:
        store = KeyStore(
            redis,
            RedisKeys(settings.redis_prefix),
            settings.pepper,
            AuditLog(producer, topics.audit, "bench"),
        )
        steady, _ = await store.create("steady-co", tier=Tier.PRO)
        bomber, _ = await store.create("bomber-co", tier=Tier.PRO)
        return {"steady": steady.key, "bomber": bomber.key}
    finally:
        await producer.stop()
        await redis.aclose()


def py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return found if Path(found).exists() else None


async def profile(pid: int, seconds: float, out: Path) -> dict[str, Any] | None:
    """``py-spy record`` of ``pid`` (raw, collapsed stacks; not blocking the target):
    each function's share of the samples it is on the stack of (inclusive)."""
    spy = py_spy()
    if spy is None:
        print("py-spy not installed (.venv/bin/pip install py-spy): no profile")
        return None
    proc = await asyncio.create_subprocess_exec(
        spy,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(int(seconds)),
        "--rate",
        "200",
        "--nonblocking",
        "--format",
        "raw",
        "--output",
        str(out),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    shares = inclusive_shares(out) if proc.returncode == 0 else None
    if shares is None:
        print(f"py-spy failed: {err.decode(errors='replace')[-300:]}")
    return shares


def inclusive_shares(path: Path) -> dict[str, Any] | None:
    """From py-spy's raw (collapsed) output: each function's share of the samples whose
    stack holds it (``inclusive_share``; the event loop's own frames, on nearly every
    stack, left out) and of those it is the innermost frame of (``self_share``)."""
    if not path.exists():
        return None
    inclusive: Counter[str] = Counter()
    innermost: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_name(frame) for frame in stack.split(";")]
        innermost[frames[-1]] += n
        for name in set(frames):
            inclusive[name] += n
    if not total:
        return None
    shown = [(k, n / total) for k, n in inclusive.most_common() if n / total < 0.9]
    return {
        "samples": total,
        "inclusive_share": {k: round(share, 3) for k, share in shown[:30]},
        "self_share": {k: round(n / total, 3) for k, n in innermost.most_common(15)},
    }


def _name(frame: str) -> str:
    """``detect (sensitive.py)`` of ``detect (services/common/sensitive.py:123)``."""
    return f"{frame.split(' (')[0]} ({_module(frame)})"


def _module(frame: str) -> str:
    """``sensitive.py`` of ``detect (services/common/sensitive.py:123)``."""
    inside = frame.partition(" (")[2].rstrip(")")
    return Path(inside.rsplit(":", 1)[0]).name


# -- the run -----------------------------------------------------------------------------------
async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--rate", type=float, default=20.0, help="steady requests/s")
    parser.add_argument("--bomb-rate", type=float, default=20.0, help="bombs/s")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds a phase")
    parser.add_argument("--kind-duration", type=float, default=10.0, help="per kind")
    parser.add_argument("--profile-s", type=float, default=10.0, help="0: no profile")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        help="NAME=VALUE for the ingress process (repeatable), e.g. SEAWALL_EVENT_LOOP=asyncio",
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.kind_duration, args.profile_s = 4.0, 3.0, 3.0
    load_before = os.getloadavg()
    out = output_dir("screen_bomb", args.quick)
    work = Path(tempfile.mkdtemp(prefix="seawall-screen-bomb-"))
    prompts = {kind: bomb_prompt(unit) for kind, unit in {**BOMBS, PLAIN: PLAIN_UNIT}.items()}
    screens = {kind: screen_cost(prompt) for kind, prompt in prompts.items()}
    screens["steady"] = screen_cost(STEADY_PROMPT)

    async with embedded_broker(work) as bootstrap:
        tag = uuid.uuid4().hex[:8]
        env = ingress_env(bootstrap, args.redis_url, tag, free_port())
        env.update(pair.split("=", 1) for pair in args.env)
        settings = IngressSettings.model_validate(
            {
                k.removeprefix("SEAWALL_").lower(): v
                for k, v in env.items()
                if k.startswith("SEAWALL_") and k != "SEAWALL_ENV_FILE"
            }
        )
        keys = await make_keys(settings)
        ready = asyncio.Event()
        fleet = asyncio.create_task(answer_everything(settings, ready))
        await ready.wait()
        async with ingress_process(env, work / "ingress.log") as ingress:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            base = f"http://127.0.0.1:{env['SEAWALL_INGRESS_PORT']}"
            async with (
                httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client,
            ):
                await phase(client, ingress, keys, args, 5.0, list(BOMBS), prompts)  # warm
                with steady_clock_hand():
                    alone = await phase(client, ingress, keys, args, args.duration, [], prompts)
                    # The mix in the middle, each kind alone on either side of it, and the
                    # alone phases at either end: their mean is the baseline of them all.
                    kinds = list(BOMBS)
                    half = len(kinds) // 2
                    each = {}
                    for kind in kinds[:half]:
                        each[kind] = await phase(
                            client, ingress, keys, args, args.kind_duration, [kind], prompts
                        )
                    mixed = await phase(client, ingress, keys, args, args.duration, kinds, prompts)
                    for kind in [*kinds[half:], PLAIN]:
                        each[kind] = await phase(
                            client, ingress, keys, args, args.kind_duration, [kind], prompts
                        )
                    after = await phase(client, ingress, keys, args, args.duration, [], prompts)
                alone_cpu_per_s = midpoint(
                    alone["ingress_cpu_s"] / alone["wall_s"],
                    after["ingress_cpu_s"] / after["wall_s"],
                )
                assert alone_cpu_per_s is not None
                for kind, run in each.items():
                    run.update(screens[kind])
                    run["cpu_ms_per_bomb"] = per_bomb_ms(run, alone_cpu_per_s * run["wall_s"])
                plain = each.pop(PLAIN)
                plain.update(screens[PLAIN])
                plain["cpu_ms_per_request"] = per_bomb_ms(plain, alone_cpu_per_s * plain["wall_s"])
                for run in each.values():
                    run["above_plain_ms"] = _minus(
                        run["cpu_ms_per_bomb"], plain["cpu_ms_per_request"]
                    )
                costliest = max(each, key=lambda k: each[k]["cpu_ms_per_bomb"] or 0.0)
                spy = None
                if args.profile_s > 0:
                    profiling = asyncio.create_task(
                        profile(ingress.pid, args.profile_s, work / "profile.txt")
                    )
                    await asyncio.sleep(0.5)
                    await phase(client, ingress, keys, args, args.profile_s, [costliest], prompts)
                    spy = await profiling
                    if spy is not None:
                        spy["kind"] = costliest
        fleet.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await fleet

    q = {
        name: midpoint(alone["steady_latency_s"][name], after["steady_latency_s"][name])
        for name in ("p50", "p99")
    }
    beside = mixed["steady_latency_s"]
    bomb_cpu = per_bomb_ms(mixed, alone_cpu_per_s * mixed["wall_s"])
    p99_ratio = ratio(beside["p99"], q["p99"])
    doc: dict[str, Any] = {
        "benchmark": "screen_bomb",
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "machine": machine(load_before, broker="embedded (Tansu, memory storage)"),
        "ingress_env": dict(pair.split("=", 1) for pair in args.env),
        "rate_per_s": args.rate,
        "bomb_rate_per_s": args.bomb_rate,
        "bomb_cpu_ms_per_request": bomb_cpu,
        "other_latency_p50_ms": {
            "alone": _ms(q["p50"]),
            "beside_bombs": _ms(beside["p50"]),
        },
        "other_latency_p99_ms": {
            "alone": _ms(q["p99"]),
            "beside_bombs": _ms(beside["p99"]),
        },
        "other_latency_p99_ratio": p99_ratio,
        "goals": {
            "bomb_cpu_ms_per_request": GOAL_CPU_MS,
            "other_latency_p99_ratio": GOAL_P99_RATIO,
            "cpu_met": bomb_cpu is not None and bomb_cpu <= GOAL_CPU_MS,
            "cpu_met_by_every_kind": all(
                (r["cpu_ms_per_bomb"] or 0.0) <= GOAL_CPU_MS for r in each.values()
            ),
            "latency_met": p99_ratio is not None and p99_ratio <= GOAL_P99_RATIO,
        },
        "ingress_alone_cpu_cores": alone_cpu_per_s,
        "bombs": each,
        "plain_16k": plain,
        "steady_screen": screens["steady"],
        "phases": {"alone": alone, "beside_mix": mixed, "alone_after": after},
        "profile": spy,
    }
    (out / "screen_bomb.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, out / "screen_bomb.png")
    report(doc)
    print(f"wrote {out / 'screen_bomb.json'} and {out / 'screen_bomb.png'}")


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _f(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def report(doc: dict[str, Any]) -> None:
    p50, p99 = doc["other_latency_p50_ms"], doc["other_latency_p99_ms"]
    print(
        f"steady tenant at {doc['rate_per_s']:.0f}/s beside {doc['bomb_rate_per_s']:.0f} bombs/s "
        f"(every kind in turn): p50 {_f(p50['beside_bombs'], '.1f')} ms against "
        f"{_f(p50['alone'], '.1f')} alone, p99 {_f(p99['beside_bombs'], '.1f')} ms against "
        f"{_f(p99['alone'], '.1f')} alone ({_f(doc['other_latency_p99_ratio'])}x, goal "
        f"{GOAL_P99_RATIO}x)"
    )
    print(
        f"ingress CPU a bomb: {_f(doc['bomb_cpu_ms_per_request'])} ms (goal {GOAL_CPU_MS} ms), "
        f"above ingress alone at {doc['ingress_alone_cpu_cores']:.3f} cores"
    )
    plain = doc["plain_16k"]
    print(
        f"  against a plain 16 KiB prompt: {_f(plain['cpu_ms_per_request'])} ms a request "
        f"(the screen alone {plain['screen_ms']:.2f} ms, count_tokens "
        f"{plain['count_tokens_ms']:.2f} ms); steady p99 "
        f"{_f(_ms(plain['steady_latency_s']['p99']), '.1f')} ms"
    )
    for kind, run in doc["bombs"].items():
        print(
            f"  {kind:13s} {_f(run['cpu_ms_per_bomb'])} ms of ingress CPU a bomb "
            f"({_f(run['above_plain_ms'], '+.2f')} against plain) "
            f"(the screen alone {run['screen_ms']:.2f} ms, count_tokens "
            f"{run['count_tokens_ms']:.2f} ms; {run['findings']} findings, "
            f"{'refused' if run['refused'] else 'forwarded'}); steady p99 "
            f"{_f(_ms(run['steady_latency_s']['p99']), '.1f')} ms; {run['bomb_outcomes']}"
        )
    spy = doc["profile"]
    if spy:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in list(spy["inclusive_share"].items())[:12])
        print(f"py-spy beside {spy['kind']} ({spy['samples']} samples), inclusive: {shares}")
        shares = ", ".join(f"{k} {v:.0%}" for k, v in list(spy["self_share"].items())[:8])
        print(f"  innermost: {shares}")


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = list(doc["bombs"])
    cpu = [doc["bombs"][k]["cpu_ms_per_bomb"] or 0.0 for k in kinds]
    screen_ms = [doc["bombs"][k]["screen_ms"] for k in kinds]
    xs = range(len(kinds))
    left.bar([x - 0.2 for x in xs], cpu, width=0.4, label="ingress CPU a bomb")
    left.bar([x + 0.2 for x in xs], screen_ms, width=0.4, label="the screen alone")
    left.axhline(GOAL_CPU_MS, color="red", linestyle="--", label=f"goal {GOAL_CPU_MS:g} ms")
    plain = doc["plain_16k"]["cpu_ms_per_request"]
    if plain is not None:
        left.axhline(plain, color="grey", linestyle=":", label="a plain 16 KiB prompt")
    left.set_xticks(list(xs), kinds)
    left.set_ylabel("ms")
    left.set_title("what a 16 KiB bomb costs ingress")
    left.legend()
    labels = ["p50", "p99"]
    alone = [doc[f"other_latency_{q}_ms"]["alone"] or 0.0 for q in labels]
    beside = [doc[f"other_latency_{q}_ms"]["beside_bombs"] or 0.0 for q in labels]
    right.bar([x - 0.2 for x in range(2)], alone, width=0.4, label="alone")
    right.bar([x + 0.2 for x in range(2)], beside, width=0.4, label="beside bombs")
    right.set_xticks(range(2), labels)
    right.set_ylabel("ms, request → HTTP response")
    right.set_title(f"the other tenant at {doc['rate_per_s']:.0f}/s")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    asyncio.run(main())
