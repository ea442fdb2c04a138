"""``seawall status`` on the real broker: telemetry from a few fake workers, decisions on
the control topic and a consumer group with committed offsets, read back as JSON."""

from __future__ import annotations

import asyncio
import io
import json
import time
from typing import Any

from aiokafka import TopicPartition
from rich.console import Console

from schemas.base import Message
from seawall.status import run_status
from seawall_client.serde import encode
from seawall_client.topics import Topics
from services.common.bus import make_consumer, make_producer
from services.common.settings import CommonSettings
from tests.signing import send_signed
from tests.unit.test_status import batch_limit, breaker, degradation, engine_stats, gpu, heartbeat


async def status_of(
    settings: CommonSettings, as_json: bool = True, window_s: float = 30.0
) -> tuple[int, str]:
    out = io.StringIO()
    console = Console(file=out, width=300, color_system=None)
    code = await asyncio.to_thread(run_status, settings, window_s, as_json, 20.0, console)
    return code, out.getvalue()


async def produce_telemetry(settings: CommonSettings, topic: str, messages: list[Message]) -> None:
    """Each message keyed by its worker, as workers do."""
    producer = make_producer(settings)
    await producer.start()
    try:
        for message in messages:
            worker_id = getattr(message, "worker_id")  # noqa: B009
            await producer.send_and_wait(topic, encode(message), key=worker_id.encode())
    finally:
        await producer.stop()


async def produce_to_partitions(
    settings: CommonSettings, topic: str, counts: dict[int, int]
) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        for partition, n in counts.items():
            for i in range(n):
                await producer.send_and_wait(topic, b"x%d" % i, partition=partition)
    finally:
        await producer.stop()


async def commit(settings: CommonSettings, group: str, offsets: dict[TopicPartition, int]) -> None:
    consumer = make_consumer(settings, group_id=group)
    await consumer.start()
    try:
        consumer.assign(list(offsets))
        await consumer.commit(offsets)
    finally:
        await consumer.stop()


async def test_status_reports_workers_decisions_and_lags(
    settings: CommonSettings, topics: Topics
) -> None:
    now = time.time()
    prefix = settings.topic_prefix
    await produce_telemetry(
        settings,
        topics.telemetry,
        [
            heartbeat("w-main", now - 1, "main", in_flight=5, batch_limit=10),
            engine_stats("w-main", now - 0.5, "main", running=4, waiting=3, kv=0.4),
            gpu("w-main", now - 0.5, "main", temp=71.0),
            heartbeat("w-small", now - 2, "small", in_flight=1),
            heartbeat("w-stale", now - 20, "small"),
        ],
    )
    control = [
        breaker(1, "worker:w-main", "open", at=now - 9),
        breaker(2, "worker:w-main", "closed", at=now - 5),
        breaker(3, "pool:main", "open", at=now - 4),
        degradation(4, "main", 1, at=now - 3),
        batch_limit(5, "w-main", 12, at=now - 2),
        batch_limit(6, "w-main", 10, at=now - 1),
    ]
    producer = make_producer(settings)
    await producer.start()
    try:
        for event in control:
            await send_signed(producer, settings, topics.control, event)
        # A forgery (unsigned) opening the small pool's breaker: the followers ignore it,
        # and so does the status.
        await producer.send_and_wait(topics.control, encode(breaker(7, "pool:small", "open")))
    finally:
        await producer.stop()
    dispatch = topics.dispatch("main")
    await produce_to_partitions(settings, dispatch, {0: 3, 1: 4})
    group = f"{prefix}seawall.workers.main"
    await commit(settings, group, {TopicPartition(dispatch, 0): 2, TopicPartition(dispatch, 1): 1})
    await commit(settings, f"{prefix}someone.else", {TopicPartition(dispatch, 0): 1})

    code, text = await status_of(settings)
    assert code == 0, text
    doc: dict[str, Any] = json.loads(text)

    workers = {w["worker_id"]: w for w in doc["workers"]}
    assert list(workers) == ["w-main", "w-small", "w-stale"]
    main = workers["w-main"]
    assert (main["pool"], main["alive"], main["status"]) == ("main", True, "serving")
    assert (main["in_flight"], main["batch_limit"]) == (6, 16)  # the newer engine stats
    assert (main["running"], main["waiting"], main["kv_cache_usage"]) == (4, 3, 0.4)
    assert [g["temperature_c"] for g in main["gpus"]] == [71.0]
    assert (workers["w-small"]["pool"], workers["w-small"]["alive"]) == ("small", True)
    assert (workers["w-stale"]["pool"], workers["w-stale"]["alive"]) == ("small", False)

    pools = {p["pool"]: p for p in doc["pools"]}
    assert pools["main"] == {
        "pool": "main",
        "workers": 1,
        "alive": 1,
        "in_flight": 6,
        "waiting": 3,
        "degradation": 1,
        "breaker": "open",
    }
    assert (pools["small"]["workers"], pools["small"]["alive"]) == (2, 1)
    assert pools["small"]["degradation"] is None

    assert [(b["scope"], b["state"], b["decided"]["seq"]) for b in doc["breakers"]] == [
        ("pool:main", "open", 3),
        ("worker:w-main", "closed", 2),
    ]
    assert [(d["scope"], d["level"]) for d in doc["degradations"]] == [("pool:main", 1)]
    assert [(b["worker_id"], b["limit"]) for b in doc["batch_limits"]] == [("w-main", 10)]
    assert doc["control_events"] == len(control)
    assert doc["control_refused"] == 1
    assert 0 < doc["control_age_s"] < 60

    assert doc["groups"] == [group]
    assert doc["lags"] == [
        {
            "group": group,
            "topic": dispatch,
            "partitions": 2,
            "committed": 2 + 1,
            "end": 3 + 4,
            "lag": (3 - 2) + (4 - 1),
        }
    ]


async def test_telemetry_sent_before_the_window_is_not_read(
    settings: CommonSettings, topics: Topics
) -> None:
    """The window picks records by their broker timestamp (not only their ``at``): a
    worker whose clock runs ahead is left out once its record is older than the window."""
    window_s = 1.5
    ahead = encode(heartbeat("w-ahead", time.time() + 60))
    producer = make_producer(settings)
    await producer.start()
    try:
        # Partition 0 gets a recent record after it; 1 and 2 get none.
        for partition in range(3):
            await producer.send_and_wait(topics.telemetry, ahead, partition=partition)
        await asyncio.sleep(window_s + 0.5)
        now = encode(heartbeat("w-now", time.time()))
        await producer.send_and_wait(topics.telemetry, now, partition=0)
    finally:
        await producer.stop()
    code, text = await status_of(settings, window_s=window_s)
    assert code == 0, text
    assert [w["worker_id"] for w in json.loads(text)["workers"]] == ["w-now"]


async def test_tables_on_empty_topics(settings: CommonSettings, topics: Topics) -> None:
    code, text = await status_of(settings, as_json=False)
    assert code == 0, text
    assert "newest decision - (0 events read)" in text
    assert "workers: none" in text
    assert "main" in text  # the configured pools are listed without workers


async def test_missing_topics_are_an_error(settings: CommonSettings) -> None:
    code, text = await status_of(settings)
    assert code == 1
    assert f"no topic {settings.topic_prefix}llm.telemetry" in text
    assert "is the stack up?" in text


async def test_no_broker_is_an_error() -> None:
    settings = CommonSettings(kafka_bootstrap="127.0.0.1:1", topic_prefix="nobody.")
    code, text = await status_of(settings)
    assert code == 1
    assert "no broker answered at 127.0.0.1:1" in text
