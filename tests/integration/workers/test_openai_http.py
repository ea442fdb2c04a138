"""The OpenAI-HTTP engine against a real server: sim-serve with the simulated engine."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from services.common.tokenizer import count_tokens
from services.workers.engine.base import EngineError, EngineOutput, EngineRequest, RequestRefused
from services.workers.engine.openai_http import OpenAIHttpConfig, OpenAIHttpEngine
from services.workers.engine.sim_config import SimConfig, SimFaults
from tests.integration.workers.conftest import MODEL, SimServer, eventually, serve_sim

pytestmark = pytest.mark.integration

PROMPT = "My parcel never arrived, can you check the tracking?"


def _engine(server: SimServer, scrape_interval_s: float = 0.05) -> OpenAIHttpEngine:
    return OpenAIHttpEngine(
        OpenAIHttpConfig(
            base_url=server.base_url,
            model=MODEL,
            limits=server.engine.limits,
            scrape_interval_s=scrape_interval_s,
        )
    )


@pytest.fixture
async def http_engine(sim_server: SimServer) -> AsyncIterator[OpenAIHttpEngine]:
    engine = _engine(sim_server)
    await engine.start()
    yield engine
    await engine.stop()


def _request(request_id: str, max_tokens: int, priority: int = 0) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt=PROMPT,
        prompt_tokens=count_tokens(PROMPT),
        max_tokens=max_tokens,
        priority=priority,
    )


async def _run(engine: OpenAIHttpEngine, request: EngineRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


async def test_generate_streams_deltas_with_the_servers_counts(
    http_engine: OpenAIHttpEngine, sim_server: SimServer
) -> None:
    outputs = await _run(http_engine, _request("a1", max_tokens=7))
    final = outputs[-1]
    assert (final.finished, final.finish_reason) == (True, "length")
    assert not any(out.finished for out in outputs[:-1])
    assert final.completion_tokens == 7
    assert sum(out.new_tokens for out in outputs) == 7
    assert [out.completion_tokens for out in outputs] == sorted(
        o.completion_tokens for o in outputs
    )
    assert all(out.request_id == "a1" for out in outputs)
    assert final.prompt_tokens == count_tokens(PROMPT)
    assert len("".join(out.text for out in outputs).split()) == 7  # one word per token
    (seen,) = sim_server.engine.requests
    assert (seen.request_id, seen.max_tokens, seen.priority) == ("a1", 7, 0)


async def test_a_server_in_priority_mode_gets_each_requests_priority() -> None:
    async with serve_sim(SimConfig(scheduling_policy="priority")) as server:
        engine = _engine(server)
        await engine.start()
        try:
            assert engine.snapshot().extra["priority_scheduling"] == -1  # not known yet
            for rid, priority in (("vip", 0), ("std", 1), ("bulk", 2)):
                final = (await _run(engine, _request(rid, max_tokens=3, priority=priority)))[-1]
                assert final.finish_reason == "length"
            assert engine.priorities is True
            assert engine.snapshot().extra["priority_scheduling"] == 1
        finally:
            await engine.stop()
    assert [(r.request_id, r.priority) for r in server.engine.requests] == [
        ("vip", 0),
        ("std", 1),
        ("bulk", 2),
    ]


async def test_a_stock_fcfs_server_serves_every_request_without_priorities(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stock ``vllm serve`` refuses any non-zero priority (400): the engine learns it
    from the first refusal, sends that request again without, and never sends one
    again — every request is served, none fails."""
    async with serve_sim(SimConfig(scheduling_policy="fcfs")) as server:
        engine = _engine(server)
        await engine.start()
        try:
            finals = [
                (await _run(engine, _request(rid, max_tokens=3, priority=priority)))[-1]
                for rid, priority in (("std", 1), ("vip", 0), ("bulk", 2))
            ]
            concurrent = await asyncio.gather(
                *(_run(engine, _request(f"c{i}", max_tokens=2, priority=2)) for i in range(4))
            )
            assert engine.priorities is False
            assert engine.snapshot().extra["priority_scheduling"] == 0
        finally:
            await engine.stop()
    assert [f.finish_reason for f in finals] == ["length"] * 3
    assert [run[-1].finish_reason for run in concurrent] == ["length"] * 4
    # What reached the engine: every request once, each with the default priority.
    assert sorted(r.request_id for r in server.engine.requests) == sorted(
        ["std", "vip", "bulk", "c0", "c1", "c2", "c3"]
    )
    assert {r.priority for r in server.engine.requests} == {0}
    refusals = [r for r in caplog.records if "first come, first served" in r.getMessage()]
    assert len(refusals) == 1


async def test_concurrent_requests_do_not_mix(http_engine: OpenAIHttpEngine) -> None:
    results = await asyncio.gather(
        *(_run(http_engine, _request(f"c{i}", max_tokens=3 + i)) for i in range(5))
    )
    for i, outputs in enumerate(results):
        assert {out.request_id for out in outputs} == {f"c{i}"}
        assert outputs[-1].completion_tokens == 3 + i


async def test_abort_ends_the_stream_and_the_server_request(
    http_engine: OpenAIHttpEngine, sim_server: SimServer
) -> None:
    outputs: list[EngineOutput] = []
    async for out in http_engine.generate(_request("ab1", max_tokens=3000)):
        outputs.append(out)
        if len(outputs) == 2:
            await http_engine.abort("ab1")
    final = outputs[-1]
    assert (final.finished, final.finish_reason, final.new_tokens) == (True, "abort", 0)
    assert final.completion_tokens == sum(out.new_tokens for out in outputs) >= 2
    await eventually(lambda: "ab1" in sim_server.engine.aborted)
    await eventually(lambda: sim_server.engine.snapshot().running == 0)


async def test_abort_of_an_unknown_request_does_nothing(http_engine: OpenAIHttpEngine) -> None:
    await http_engine.abort("nobody")
    outputs = await _run(http_engine, _request("after", max_tokens=2))
    assert outputs[-1].finish_reason == "length"


async def test_leaving_the_stream_early_closes_the_server_request(
    http_engine: OpenAIHttpEngine, sim_server: SimServer
) -> None:
    stream = http_engine.generate(_request("quitter", max_tokens=3000))
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    await eventually(lambda: "quitter" in sim_server.engine.aborted)


async def test_snapshot_follows_the_servers_metrics(
    http_engine: OpenAIHttpEngine, sim_server: SimServer
) -> None:
    assert http_engine.limits == sim_server.engine.limits
    assert http_engine.snapshot().extra["metrics_stale"] == 0.0
    stream = http_engine.generate(_request("long", max_tokens=3000))
    await anext(stream)
    await eventually(lambda: http_engine.snapshot().running == 1)
    assert http_engine.snapshot().kv_cache_usage > 0.0
    await http_engine.abort("long")
    async for _ in stream:
        pass
    await eventually(lambda: http_engine.snapshot().running == 0)
    snapshot = http_engine.snapshot()
    assert snapshot.generation_tokens_total == sim_server.engine.snapshot().generation_tokens_total
    assert snapshot.prompt_tokens_total >= count_tokens(PROMPT)


async def test_a_refused_request_is_refused_not_an_engine_failure(
    http_engine: OpenAIHttpEngine,
) -> None:
    too_long = _request("big", max_tokens=10**6)
    with pytest.raises(RequestRefused, match="HTTP 400: This model's maximum context length"):
        await _run(http_engine, too_long)
    outputs = await _run(http_engine, _request("after", max_tokens=3))  # still serving
    assert outputs[-1].finish_reason == "length"


async def test_a_failed_request_ends_with_finish_reason_error() -> None:
    async with serve_sim(SimConfig(faults=SimFaults(error_rate=1.0))) as server:
        engine = _engine(server)
        await engine.start()
        try:
            outputs = await _run(engine, _request("doomed", max_tokens=50))
        finally:
            await engine.stop()
    final = outputs[-1]
    assert (final.finished, final.finish_reason) == (True, "error")
    assert final.error is not None
    assert "simulated request failure" in final.error


async def test_start_fails_clearly_without_a_server() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        engine = OpenAIHttpEngine(
            OpenAIHttpConfig(
                base_url=f"http://127.0.0.1:{port}",
                model=MODEL,
                limits=SimConfig().limits(),
            )
        )
        with pytest.raises(EngineError, match="cannot scrape"):
            await engine.start()
        with pytest.raises(EngineError, match="not started"):
            await _run(engine, _request("x", max_tokens=1))


async def test_start_and_stop_are_idempotent_and_stop_ends_the_scraper(
    sim_server: SimServer,
) -> None:
    engine = _engine(sim_server)
    await engine.start()
    await engine.start()
    scrapers = [t for t in asyncio.all_tasks() if t.get_name() == "openai-http-scrape"]
    assert len(scrapers) == 1
    await engine.stop()
    await engine.stop()
    assert scrapers[0].done()
    assert not any(t.get_name() == "openai-http-scrape" for t in asyncio.all_tasks())


async def test_stop_ends_streams_in_flight(
    sim_server: SimServer,
) -> None:
    engine = _engine(sim_server)
    await engine.start()
    stream = engine.generate(_request("cut", max_tokens=3000))
    await anext(stream)
    await engine.stop()
    rest = [out async for out in stream]
    assert rest[-1].finish_reason == "abort"
    await eventually(lambda: "cut" in sim_server.engine.aborted)


async def test_snapshot_goes_stale_when_the_server_leaves() -> None:
    async with serve_sim() as server:
        engine = _engine(server)
        await engine.start()
    try:
        await eventually(lambda: engine.snapshot().extra["metrics_stale"] == 1.0)
    finally:
        await engine.stop()
