"""The worker on the real broker, driving the simulated engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from schemas import (
    BatchLimit,
    BreakerLevel,
    BreakerState,
    DeadLetter,
    Evidence,
    ReasonCode,
    ReplyStatus,
    RequestSummary,
    WorkerReport,
)
from seawall_client.serde import TELEMETRY, decode, encode
from seawall_client.topics import Topics
from services.common.bus import make_consumer
from services.common.settings import CommonSettings
from services.common.tokenizer import count_tokens
from services.workers.service import Worker
from tests.fleet import (
    ReplyReader,
    dispatched,
    produce,
    read_telemetry,
    sim_worker,
    until,
    worker_settings,
)


@pytest.fixture
async def worker(
    settings: CommonSettings, topics: Topics, request: pytest.FixtureRequest
) -> AsyncIterator[Worker]:
    ws = worker_settings(settings, **{"sim_time_scale": 0.2, **getattr(request, "param", {})})
    async with sim_worker(ws) as w:
        yield w


async def test_every_request_gets_its_chunks_then_one_terminal_reply(
    settings: CommonSettings, topics: Topics, worker: Worker
) -> None:
    n = 12
    async with ReplyReader(settings, topics) as client:
        requests = [dispatched(i, client.topic, max_tokens=40, stream=i % 3 != 0) for i in range(n)]
        await produce(settings, topics.dispatch("main"), requests)
        await client.wait_terminals(n)
        for _ in range(5):
            await client.poll(100)  # anything that would come after the terminal reply

    assert sorted(client.terminals) == sorted(d.request.request_id for d in requests)
    for d in requests:
        rid = d.request.request_id
        (reply,) = client.terminals[rid]
        assert reply.status is ReplyStatus.OK
        assert reply.completion_tokens == 40
        assert reply.finish_reason == "length"
        chunks = client.chunks.get(rid, [])
        if d.request.stream:
            assert [c.seq for c in chunks] == list(range(reply.chunks))
            assert 1 <= reply.chunks < 40  # coalesced: far fewer records than tokens
            assert "".join(c.text for c in chunks) == reply.text
            assert sum(c.tokens for c in chunks) == 40
        else:
            assert chunks == []
            assert reply.chunks == 0


async def test_telemetry_of_every_kind(
    settings: CommonSettings, topics: Topics, worker: Worker
) -> None:
    async with ReplyReader(settings, topics) as client:
        await produce(settings, topics.dispatch("main"), [dispatched(0, client.topic)])
        await client.wait_terminals(1)
    kinds = {"request_completed", "worker_report", "engine_stats", "gpu_stats", "worker_heartbeat"}
    seen = await read_telemetry(settings, topics, kinds)
    assert set(seen) >= kinds
    (done,) = seen["request_completed"]
    assert done.request_id == "req-0"  # type: ignore[attr-defined]
    assert done.completion_tokens == 32  # type: ignore[attr-defined]
    assert done.seq == 1  # type: ignore[attr-defined]
    assert all(g.simulated for g in seen["gpu_stats"])  # type: ignore[attr-defined]
    # the request is in one report's summary, and the reports after it count it done
    summary = await first_summary(settings, topics)
    assert (summary.count, summary.errors, summary.completion_tokens) == (1, 0, 32)
    assert summary.latency.count == 1


async def first_summary(settings: CommonSettings, topics: Topics) -> RequestSummary:
    """The first report's summary that holds a request."""
    consumer = make_consumer(settings, topics.telemetry, group_id=None)
    await consumer.start()
    try:
        async with asyncio.timeout(30):
            async for record in consumer:
                report = decode(TELEMETRY, record.value)
                if isinstance(report, WorkerReport) and report.requests and report.requests.count:
                    assert report.heartbeat.completed_total == report.requests.count
                    return report.requests
    finally:
        await consumer.stop()
    raise AssertionError("the consumer stopped")


@pytest.mark.parametrize("worker", [{"sim_time_scale": 100.0}], indirect=True)
async def test_prompt_tokens_before_their_first_token_are_reported_as_pending_prefill(
    settings: CommonSettings, topics: Topics, worker: Worker
) -> None:
    prompt = "word " * 1500
    async with ReplyReader(settings, topics) as client:
        await produce(
            settings,
            topics.dispatch("main"),
            [dispatched(0, client.topic, max_tokens=2, prompt=prompt)],
        )
        await until(lambda: worker.prefill_pending_tokens > 0)
        pending = worker.prefill_pending_tokens
        reported: list[int] = []
        while pending not in reported and worker.prefill_pending_tokens:
            seen = await read_telemetry(settings, topics, {"engine_stats"}, timeout_s=2)
            reported = [s.prefill_pending_tokens for s in seen["engine_stats"]]  # type: ignore[attr-defined]
        await client.wait_terminals(1)
    assert pending == count_tokens(prompt)
    assert pending in reported  # the worker's EngineStats said so while it lasted
    assert worker.prefill_pending_tokens == 0


@pytest.mark.parametrize("worker", [{"batch_limit": 8, "sim_time_scale": 2.0}], indirect=True)
async def test_batch_limit_event_changes_the_in_flight_count(
    settings: CommonSettings, topics: Topics, worker: Worker
) -> None:
    samples: list[int] = []

    def sample(pred: object) -> bool:
        samples.append(worker.in_flight)
        return bool(pred)

    async with ReplyReader(settings, topics) as client:
        await produce(
            settings,
            topics.dispatch("main"),
            [dispatched(i, client.topic, max_tokens=150) for i in range(40)],
        )
        await until(lambda: sample(worker.in_flight == 8))
        assert max(samples) == 8

        event = BatchLimit(
            scope="worker:w1",
            seq=1,
            issued_at=time.time(),
            worker_id="w1",
            limit=3,
            evidence=Evidence(reason="test"),
        )
        await produce(settings, topics.control, [event])
        await until(lambda: worker.batch_limit == 3)
        await until(lambda: worker.in_flight <= 3)
        samples.clear()
        deadline = time.monotonic() + 120
        while len(client.terminals) < 16 and time.monotonic() < deadline:
            await client.poll(20)
            samples.append(worker.in_flight)
        assert len(client.terminals) >= 16
        assert max(samples) == 3  # never above the new limit, and the limit is used

        # a limit above the engine's max_num_seqs is clamped to it
        worker.set_batch_limit(10_000)
        assert worker.batch_limit == worker.engine.limits.max_num_seqs


def breaker(state: str, seq: int, *tripped: str) -> BreakerState:
    return BreakerState(
        scope="worker:w1",
        seq=seq,
        issued_at=time.time(),
        state=state,  # type: ignore[arg-type]
        level=BreakerLevel.LOG if tripped else BreakerLevel.NONE,
        tripped=tripped,
        evidence=Evidence(reason="test"),
    )


async def test_an_isolated_worker_leaves_its_partitions_to_the_pool_until_half_open(
    settings: CommonSettings, topics: Topics, worker: Worker
) -> None:
    async with (
        sim_worker(worker_settings(settings, instance_id="w2", sim_time_scale=0.2)) as w2,
        ReplyReader(settings, topics) as client,
    ):
        await produce(settings, topics.control, [breaker("open", 1, "error_rate")])
        await until(lambda: worker.stepped_aside)
        assert not worker.partitions
        first = [dispatched(i, client.topic, max_tokens=8) for i in range(6)]
        await produce(settings, topics.dispatch("main"), first)
        await client.wait_terminals(6, timeout_s=60)
        assert {r[0].worker_id for r in client.terminals.values()} == {"w2"}
        assert not w2.stepped_aside

        await produce(settings, topics.control, [breaker("half_open", 2)])
        await until(lambda: not worker.stepped_aside)
        await until(lambda: bool(worker.partitions), timeout_s=60)  # the rebalance
        later = [dispatched(i, client.topic, max_tokens=8) for i in range(6, 30)]
        await produce(settings, topics.dispatch("main"), later)
        await client.wait_terminals(30, timeout_s=90)
    # Back in the group, the first worker takes its share again (probes included).
    assert "w1" in {client.terminals[d.request.request_id][0].worker_id for d in later}


async def test_expired_requests_get_an_expired_reply_without_engine_time(
    settings: CommonSettings, topics: Topics, worker: Worker
) -> None:
    async with ReplyReader(settings, topics) as client:
        late = dispatched(1, client.topic, deadline_in_s=0.001)
        await asyncio.sleep(0.01)
        await produce(settings, topics.dispatch("main"), [late])
        await client.wait_terminals(1)
    (reply,) = client.terminals["req-1"]
    assert reply.status is ReplyStatus.EXPIRED
    assert worker.engine.snapshot().generation_tokens_total == 0


async def test_a_malformed_record_is_dead_lettered_and_the_worker_carries_on(
    settings: CommonSettings, topics: Topics, worker: Worker
) -> None:
    """Records no worker can use: undecodable, replies to a topic nobody created or that
    is no reply topic (dead letters); a prompt longer than the engine's context (an
    error reply). The worker keeps its partitions and serves what follows."""
    async with ReplyReader(settings, topics) as client:
        good = dispatched(7, client.topic)
        nowhere = dispatched(8, topics.reply("nobody-home"))
        foreign = dispatched(9, topics.control)
        too_long = dispatched(10, client.topic, max_tokens=4)
        too_long = too_long.model_copy(
            update={"request": too_long.request.model_copy(update={"prompt": "word " * 5000})}
        )
        await produce(
            settings,
            topics.dispatch("main"),
            [b"{not json", b'{"type": "dispatched_request"}', nowhere, foreign, too_long, good],
        )
        await client.wait_terminals(2)
    assert client.terminals["req-7"][0].status is ReplyStatus.OK
    (refused,) = client.terminals["req-10"]
    assert (refused.status, refused.reason, refused.code) == (
        ReplyStatus.ERROR,
        ReasonCode.INVALID_REQUEST,
        "engine_refused",
    )
    assert "max_model_len" in refused.message
    assert not worker.failed.is_set()

    consumer = make_consumer(settings, topics.deadletter, group_id=None)
    await consumer.start()
    letters: list[DeadLetter] = []
    try:
        deadline = time.monotonic() + 20
        while len(letters) < 4 and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                letters += [DeadLetter.model_validate_json(r.value) for r in records]
    finally:
        await consumer.stop()
    assert sorted(letter.reason for letter in letters) == [
        "invalid_json",
        "invalid_reply_to",
        "reply_topic_unreachable",
        "schema_violation",
    ]
    assert {b"{not json", b'{"type": "dispatched_request"}'} <= {
        letter.excerpt for letter in letters
    }
    assert all(letter.source_topic == topics.dispatch("main") for letter in letters)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        assert topics.reply("nobody-home") not in await admin.list_topics()
    finally:
        await admin.close()
    assert encode(good)  # the good record was served after the bad ones (above)
