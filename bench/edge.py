"""Edge security's cost: do 1,000 bad signatures for one key id slow the Kafka ingress
down for other tenants? (issue 13)

One ingress (in this process; HTTP off) on the embedded broker and the local Redis, a
tenant's key and a victim key. Good records, signed by the tenant's key, go to
``llm.ingress`` open-loop at ``--rate`` for ``--duration`` seconds; each one's latency
is the time from its produce to its appearance on its priority topic. Three times, on
the same ingress: the baseline, the attack run, in which 1,000 records claiming the
victim's key id with a wrong signature are produced in one burst a second after the
start, and the baseline again. The figures are the good records' latency percentiles
in each run, the attack run's as a ratio to the mean of the two baselines' (the bound
stated: p99 at most 1.5×; the embedded broker slows down as its topics fill, so a
baseline before the attack alone would count that drift as the attack's cost; until
2026-12-07 it was the only one, ``p99_ratio_before``), and what became of the bad ones.

Writes ``results/edge.json`` and ``results/edge.png``; ``--quick``: a shorter run, into a
temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _common import commit, embedded_broker, machine, midpoint, output_dir, ratio, summary
from aiokafka import AIOKafkaProducer

from schemas import InferenceRequest, Priority, SamplingParams, Tier
from schemas.signed import HEADER_KEY_ID, HEADER_SIGNATURE, HEADER_TIMESTAMP
from seawall_client import signing
from seawall_client.kafka import ensure_topics
from seawall_client.serde import REQUEST, decode, encode
from services.common.bus import make_consumer, make_producer, topics_of
from services.common.settings import CommonSettings
from services.ingress.service import IngressService
from services.ingress.settings import IngressSettings

PEPPER = "bench-edge-pepper-0123456789"
BAD = 1_000


async def run_once(
    settings: CommonSettings,
    key: str,
    victim_key_id: str,
    rate: float,
    duration_s: float,
    attack: bool,
) -> dict[str, Any]:
    topics = topics_of(settings)
    key_id = signing.key_id_of(key)
    assert key_id is not None
    reply_to = topics.reply(f"{key_id}.bench")
    run = uuid.uuid4().hex[:6]
    reader = make_consumer(settings, *(topics.requests(p) for p in Priority), group_id=None)
    await reader.start()
    await reader.seek_to_end()
    producer: AIOKafkaProducer = make_producer(settings, linger_ms=1)
    await producer.start()
    sent: dict[str, float] = {}
    took: list[float] = []
    n = int(rate * duration_s)

    async def read() -> None:
        while len(took) < n:
            for records in (await reader.getmany(timeout_ms=100)).values():
                arrived = time.monotonic()
                for r in records:
                    rid = decode(REQUEST, r.value).request_id
                    if rid in sent:
                        took.append(arrived - sent.pop(rid))

    async def flood() -> float:
        await asyncio.sleep(1.0)
        started = time.monotonic()
        for i in range(BAD):
            value = encode(
                InferenceRequest(
                    request_id=f"bad-{run}-{i}",
                    tenant="x",
                    api_key_id=victim_key_id,
                    prompt="let me in",
                    reply_to=topics.reply(f"{victim_key_id}.bench"),
                    created_at=time.time(),
                )
            )
            forged = f"v1={os.urandom(32).hex()}"
            headers = [
                (HEADER_KEY_ID, victim_key_id.encode()),
                (HEADER_TIMESTAMP, str(int(time.time())).encode()),
                (HEADER_SIGNATURE, forged.encode()),
            ]
            await producer.send(topics.ingress, value, key=f"bad{i}".encode(), headers=headers)
        return time.monotonic() - started

    reading = asyncio.create_task(read())
    flooding = asyncio.create_task(flood()) if attack else None
    for i in range(n):
        rid = f"good-{run}-{i}"
        value = encode(
            InferenceRequest(
                request_id=rid,
                tenant="x",
                api_key_id=key_id,
                prompt=f"question {i}",
                sampling=SamplingParams(max_tokens=8),
                reply_to=reply_to,
                created_at=time.time(),
            )
        )
        sent[rid] = time.monotonic()
        await producer.send(
            topics.ingress,
            value,
            key=f"t{i % 16}".encode(),
            headers=signing.sign(key, key_id, value, time.time()),
        )
        await asyncio.sleep(1 / rate)
    try:
        await asyncio.wait_for(reading, 60)
    except TimeoutError:
        reading.cancel()
    flood_s = await flooding if flooding is not None else None
    await producer.stop()
    await reader.stop()
    return {"good": n, "answered": len(took), "latency_s": summary(took), "flood_s": flood_s}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.duration = 4.0
    load_before = os.getloadavg()
    out = output_dir("edge", args.quick)
    work = Path(tempfile.mkdtemp(prefix="seawall-edge-"))
    async with embedded_broker(work) as bootstrap:
        tag = uuid.uuid4().hex[:8]
        settings = IngressSettings(
            kafka_bootstrap=bootstrap,
            kafka_idempotence=False,
            redis_url=args.redis_url,
            topic_prefix=f"edge{tag}.",
            redis_prefix=f"bench:edge:{tag}:",
            instance_id=f"edge-{tag}",
            ingress_port=0,
            key_pepper=PEPPER,
            log_level="WARNING",
        )
        topics = topics_of(settings)
        async with IngressService(settings) as service:  # what is measured
            key, _ = await service.keystore.create("bench-co", tier=Tier.ENTERPRISE)
            victim, _ = await service.keystore.create("victim-co", tier=Tier.PRO)
            for k in (key, victim):
                await ensure_topics(bootstrap, [topics.reply_spec(f"{k.record.key_id}.bench")])
            # warm: the group has joined and the key is read
            await run_once(settings, key.key, victim.record.key_id, 20, 2, False)
            baseline = await run_once(
                settings, key.key, victim.record.key_id, args.rate, args.duration, False
            )
            attack = await run_once(
                settings, key.key, victim.record.key_id, args.rate, args.duration, True
            )
            after = await run_once(
                settings, key.key, victim.record.key_id, args.rate, args.duration, False
            )
            dead = await count_letters(settings)
    a = attack["latency_s"]
    b = {q: midpoint(baseline["latency_s"][q], after["latency_s"][q]) for q in ("p50", "p99")}
    doc = {
        "benchmark": "edge",
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(load_before, broker="embedded (Tansu, memory storage)"),
        "rate_per_s": args.rate,
        "duration_s": args.duration,
        "bad_signatures": BAD,
        "baseline": baseline,
        "under_attack": attack,
        "baseline_after": after,
        "baseline_latency_s": b,
        "p50_ratio": ratio(a["p50"], b["p50"]),
        "p99_ratio": ratio(a["p99"], b["p99"]),
        "p99_ratio_before": ratio(a["p99"], baseline["latency_s"]["p99"]),
        "bound_p99_ratio": 1.5,
        "bad_records_dead_lettered": dead,
    }
    (out / "edge.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, out / "edge.png")
    print(
        f"good records at {args.rate:.0f}/s: p50 {b['p50']:.3f} s, p99 {b['p99']:.3f} s alone "
        "(the mean of before and after); "
        f"p50 {a['p50']:.3f} s, p99 {a['p99']:.3f} s with {BAD} bad signatures "
        f"({doc['p99_ratio']:.2f}x at p99, bound 1.5x); {dead} bad records dead-lettered"
    )
    print(f"wrote {out / 'edge.json'} and {out / 'edge.png'}")


async def count_letters(settings: CommonSettings) -> int:
    reader = make_consumer(settings, topics_of(settings).deadletter, group_id=None)
    await reader.start()
    count, quiet = 0, 0
    try:
        while quiet < 5:
            batches = await reader.getmany(timeout_ms=300)
            got = sum(len(r) for r in batches.values())
            count += got
            quiet = 0 if got else quiet + 1
    finally:
        await reader.stop()
    return count


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = ["p50", "p99", "max"]
    runs = (
        ("alone, before", "baseline"),
        ("1,000 bad", "under_attack"),
        ("alone, after", "baseline_after"),
    )
    for i, (name, run) in enumerate(runs):
        values = [doc[run]["latency_s"][k] * 1000 for k in labels]
        ax.bar([x + (i - 1) * 0.27 for x in range(3)], values, width=0.27, label=name)
    ax.set_xticks(range(3), labels)
    ax.set_ylabel("ms, produce → priority topic")
    ax.set_title(f"good records at {doc['rate_per_s']:.0f}/s through the Kafka ingress")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    asyncio.run(main())
