"""Faults: nothing lost while every part dies in turn, and what 100–500 ms of network
delay costs, on ``seawall up`` (issue 12).

1. **Kill matrix** (``tests/chaos.py``, the same driver as the end-to-end test, with
   more traffic): an open-loop stream of streamed SDK requests from three tiers while
   ingress, admission, the main worker streaming the most and the controller are each
   SIGKILLed in turn and Redis is cut off for 5 s. Counted at the callers: submitted,
   terminal replies, lost, duplicates that reached a caller, streams ended with
   ``stream_interrupted``; the peak consumer lag of ingress and admission (the backlog
   built while they were down); and what became of the requests the killed worker held
   (dispatched to its partitions, unanswered at the kill; half the traffic is not
   streamed): **failover to completion**, kill → a normal reply from another worker, for
   those that had shown no text (not streamed, or queued); and kill → the documented
   ``stream_interrupted`` error for streams that had (``stream_interrupted_after_s``,
   what this file called "failover" before: an error, not a completion).
2. **Network delay**: the same requests through a TCP proxy between every service and
   the broker, first passing bytes at once, then holding each for a random 100–500 ms.
   Baseline, in the same run and through the same proxy: a bare chain of the same
   broker hops (producer → relay → relay → relay → consumer, each relay a consumer
   group that produces the record on and commits after the ack, as the services do),
   with a worker's generation time added. "Over the delay" is seawall's p99 minus the
   chain's p99 under the same delay.

Writes ``results/faults.json`` (keys ``submitted``, ``terminal_replies``, ``lost``,
``duplicates_to_caller``, ``failover_to_completion_s_p50``/``_p99``,
``stream_interrupted_after_s_p99`` and the details; goal: completion p99 ≤ 10 s) and
``results/faults.png``. ``--quick``: less traffic, into a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from _common import commit, machine, output_dir, summary

# The driver, the proxies and `seawall up` come from the test support package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokafka import AIOKafkaProducer

from seawall_client import SeawallClient
from seawall_client.kafka import ensure_topics
from seawall_client.topics import TopicSpec
from services.common.bus import make_consumer, make_producer
from services.common.settings import CommonSettings
from tests.chaos import Traffic, failed, kill_matrix, timed_calls
from tests.faults import TcpProxy
from tests.stack import behind_delay, launch

RELAYS = 3
"""ingress, admission and the worker: the services a request passes between its
producer's record and the reply its producer reads."""


async def run_kill_matrix(work: Path, redis_url: str, traffic: Traffic) -> dict[str, Any]:
    target = urlsplit(redis_url)
    with (
        TcpProxy(target.hostname or "127.0.0.1", target.port or 6379) as proxy,
        launch(work / "kill-matrix", proxy.url()) as stack,
    ):
        return await kill_matrix(stack, proxy, traffic)


async def relay(settings: CommonSettings, source: str, sink: str, stop: asyncio.Event) -> None:
    """A bare service: consume ``source`` in a group, produce each record to ``sink``,
    commit after the acks."""
    consumer = make_consumer(settings, source, group_id=f"relay-{source}")
    producer = make_producer(settings)
    await consumer.start()
    await producer.start()
    try:
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=200)
            acks = [
                await producer.send(sink, r.value, key=r.key)
                for records in batches.values()
                for r in records
            ]
            await asyncio.gather(*acks)
            if batches:
                await consumer.commit({tp: rs[-1].offset + 1 for tp, rs in batches.items()})
    finally:
        await consumer.stop()
        await producer.stop()


async def chain_latencies(
    settings: CommonSettings, n: int, rate_per_s: float, generation_s: float
) -> list[float]:
    """``n`` records at ``rate_per_s`` through ``RELAYS`` relays; each one's latency plus
    ``generation_s`` (what the simulated engine takes to answer, measured alone)."""
    topics = [f"chain-{uuid.uuid4().hex[:6]}.{i}" for i in range(RELAYS + 1)]
    await ensure_topics(settings.kafka_bootstrap, [TopicSpec(t, 3) for t in topics])
    stop = asyncio.Event()
    relays = [
        asyncio.create_task(relay(settings, a, b, stop)) for a, b in itertools.pairwise(topics)
    ]
    reader = make_consumer(settings, topics[-1], group_id=None, auto_offset_reset="earliest")
    producer: AIOKafkaProducer = make_producer(settings)
    await reader.start()
    await producer.start()
    sent: dict[bytes, float] = {}
    took: list[float] = []

    async def read() -> None:
        while len(took) < n:
            for records in (await reader.getmany(timeout_ms=100)).values():
                arrived = time.monotonic()
                for r in records:
                    if r.key in sent:
                        took.append(arrived - sent.pop(r.key) + generation_s)

    try:
        await warm_up(producer, reader, topics[0])
        reading = asyncio.create_task(read())
        for i in range(n):
            key = f"m{i}".encode()
            sent[key] = time.monotonic()
            await producer.send(topics[0], b"x" * 400, key=key)
            await asyncio.sleep(1 / rate_per_s)
        with contextlib.suppress(TimeoutError):  # what did not arrive shows in n
            await asyncio.wait_for(reading, 60)
    finally:
        stop.set()
        await asyncio.gather(*relays, return_exceptions=True)
        await producer.stop()
        await reader.stop()
    return took


async def warm_up(producer: AIOKafkaProducer, reader: Any, first: str) -> None:
    """Until a record makes it through: every relay's group has joined and consumes."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        await producer.send_and_wait(first, b"warm", key=b"warm")
        for _ in range(10):
            for records in (await reader.getmany(timeout_ms=200)).values():
                if any(r.key == b"warm" for r in records):
                    return  # (each relay is its group's only member: it has every partition)
    raise TimeoutError("the relay chain did not start")


async def run_delay(work: Path, redis_url: str, n: int, rate_per_s: float) -> dict[str, Any]:
    async with behind_delay(
        work / "delay", redis_url, "--workers", "1", "--small-workers", "0"
    ) as (
        stack,
        proxy,
    ):
        key = stack.key("delay-co", "enterprise")
        async with SeawallClient(api_key=key["key"], kafka=stack.settings.kafka) as c:
            await timed_calls(c, 10, 2.0, "warm")
            alone = [t for t, _ in await timed_calls(c, 5, 0.5, "alone")]
            generation_s = min(alone)  # the engine and one pass, nothing queued
            plain = await timed_calls(c, n, rate_per_s, "plain")
            chain_plain = await chain_latencies(stack.settings, n, rate_per_s, 0.0)
            proxy.low_s, proxy.high_s = 0.1, 0.5
            delayed = await timed_calls(c, n, rate_per_s, "delayed")
            chain_delayed = await chain_latencies(stack.settings, n, rate_per_s, 0.0)
    seawall_plain = summary([t for t, _ in plain])
    seawall_delayed = summary([t for t, _ in delayed])
    chain_plain_s = summary([t + generation_s for t in chain_plain])
    chain_delayed_s = summary([t + generation_s for t in chain_delayed])
    over = (
        seawall_delayed["p99"] - chain_delayed_s["p99"]
        if seawall_delayed["p99"] is not None and chain_delayed_s["p99"] is not None
        else None
    )
    return {
        "requests": n,
        "rate_per_s": rate_per_s,
        "errors": failed(delayed),
        "error_rate": len(failed(delayed)) / n,
        "generation_s": generation_s,
        "seawall_without_delay_s": seawall_plain,
        "seawall_with_delay_s": seawall_delayed,
        "chain_without_delay_s": chain_plain_s,
        "chain_with_delay_s": chain_delayed_s,
        "p99_over_the_delay_s": over,
        "chunks_delayed": proxy.delayed,
        "latencies_s": {
            "seawall_without_delay": sorted(t for t, _ in plain),
            "seawall_with_delay": sorted(t for t, _ in delayed),
            "chain_with_delay": sorted(t + generation_s for t in chain_delayed),
        },
    }


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    km = doc["kill_matrix"]
    completed, interrupted = km["failover_to_completion_s"], km["stream_interrupted_after_s"]
    left.hist(
        [completed, interrupted],
        bins=20,
        color=["tab:blue", "tab:orange"],
        label=[
            f"completed elsewhere ({len(completed)})",
            f"stream_interrupted ({len(interrupted)})",
        ],
    )
    left.axvline(10, color="tab:red", linestyle="--", label="goal: 10 s")
    left.set_title("the killed worker's requests: seconds from the kill")
    left.set_xlabel("seconds")
    left.legend()
    for name, values in doc["network_delay"]["latencies_s"].items():
        ys = [(i + 1) / len(values) for i in range(len(values))]
        right.plot(values, ys, label=name.replace("_", " "))
    right.set_title("latency, 100–500 ms on every broker leg")
    right.set_xlabel("seconds")
    right.set_ylabel("share of requests")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--quick", action="store_true", help="less traffic, a temporary dir")
    args = parser.parse_args()
    os.environ.setdefault("SEAWALL_ENV_FILE", os.devnull)
    load_before = os.getloadavg()
    out = output_dir("faults", args.quick)
    traffic = Traffic(rate_per_s=15 if args.quick else 30, duration_s=36, max_tokens=24)
    work = Path(tempfile.mkdtemp(prefix="seawall-faults-"))
    started = time.monotonic()
    km = await run_kill_matrix(work, args.redis_url, traffic)
    delay = await run_delay(work, args.redis_url, 30 if args.quick else 90, 3.0)
    doc = {
        "benchmark": "faults",
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "machine": machine(load_before, broker="embedded (Tansu, memory storage)"),
        "took_s": round(time.monotonic() - started, 1),
        "submitted": km["submitted"],
        "terminal_replies": km["terminal_replies"],
        "lost": km["lost"],
        "duplicates_to_caller": km["duplicates_to_caller"],
        "failover_to_completion_s_p50": km["failover_to_completion_s_p50"],
        "failover_to_completion_s_p99": km["failover_to_completion_s_p99"],
        "stream_interrupted_after_s_p99": km["stream_interrupted_after_s_p99"],
        "kill_matrix": {"traffic": traffic.__dict__, **km},
        "network_delay": delay,
    }
    (out / "faults.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, out / "faults.png")
    d = delay
    print(
        f"kill matrix: {km['submitted']} submitted, {km['terminal_replies']} terminal replies, "
        f"{km['lost']} lost, {km['duplicates_to_caller']} duplicates to a caller, "
        f"{km['streams_interrupted']} streams interrupted; backlog peak {km['backlog_peak']}; "
    )
    held = km["on_killed_worker"]
    print(
        f"killed worker: held {held['held']} requests; {held['completed_elsewhere']} of "
        f"{held['to_complete']} with no text shown completed elsewhere, kill → completion "
        f"p50 {km['failover_to_completion_s_p50']} s, p99 "
        f"{km['failover_to_completion_s_p99']} s (goal 10 s); {held['showed_text']} streams "
        f"that had shown text ended stream_interrupted, p99 "
        f"{km['stream_interrupted_after_s_p99']} s after the kill"
    )
    names = ("seawall_with_delay_s", "chain_with_delay_s")
    p99 = {k: d[k]["p99"] for k in (*names, "seawall_without_delay_s", "chain_without_delay_s")}
    print(
        f"network delay: error rate {d['error_rate']:.3%}; p99 "
        f"{p99['seawall_with_delay_s']:.2f} s against the bare chain's "
        f"{p99['chain_with_delay_s']:.2f} s under the same delay "
        f"({d['p99_over_the_delay_s']:+.2f} s over it); without the delay "
        f"{p99['seawall_without_delay_s']:.2f} s against {p99['chain_without_delay_s']:.2f} s"
    )
    print(f"wrote {out / 'faults.json'} and {out / 'faults.png'}")


if __name__ == "__main__":
    asyncio.run(main())
