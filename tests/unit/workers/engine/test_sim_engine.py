"""The simulated engine behind ``base.Engine``, on virtual time (plus one real-time run)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from services.common.tokenizer import count_tokens
from services.workers.engine.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    RequestRefused,
)
from services.workers.engine.sim import SimulatedEngine
from services.workers.engine.sim_config import SimConfig, SimFaults

pytestmark = pytest.mark.unit


class VirtualTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def started(
    config: SimConfig | None = None, seed: int = 0
) -> AsyncIterator[tuple[SimulatedEngine, VirtualTime]]:
    time = VirtualTime()
    engine = SimulatedEngine(config, seed=seed, sleep=time.sleep, clock=time.clock)
    await engine.start()
    try:
        yield engine, time
    finally:
        await engine.stop()


def request(request_id: str = "a", max_tokens: int = 5, **kwargs: object) -> EngineRequest:
    return EngineRequest(
        request_id=request_id, prompt="hello there", prompt_tokens=100, max_tokens=max_tokens,
        **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


async def collect(engine: SimulatedEngine, req: EngineRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(req)]


def other_tasks() -> set[asyncio.Task[object]]:
    return asyncio.all_tasks() - {asyncio.current_task()}


async def test_it_is_an_engine() -> None:
    assert isinstance(SimulatedEngine(), Engine)
    assert SimulatedEngine.name == "sim"


async def test_streams_one_token_per_step_then_finishes() -> None:
    async with started() as (engine, time):
        start = time.now
        outputs = await collect(engine, request(max_tokens=5))
    assert [o.new_tokens for o in outputs] == [1] * 5
    assert [o.completion_tokens for o in outputs] == [1, 2, 3, 4, 5]
    assert [o.finished for o in outputs] == [False] * 4 + [True]
    assert outputs[-1].finish_reason == "length"
    assert {o.prompt_tokens for o in outputs} == {100}
    assert count_tokens("".join(o.text for o in outputs)) == 5
    # A 100-token prefill (≈ 11.4 ms) then four decode steps (≈ 10.9 ms each).
    assert time.now - start == pytest.approx(0.055, rel=0.05)


async def test_concurrent_requests_share_steps() -> None:
    async with started() as (engine, time):
        start = time.now
        results = await asyncio.gather(*(collect(engine, request(f"r{i}", 50)) for i in range(8)))
        elapsed = time.now - start
    assert all(r[-1].completion_tokens == 50 for r in results)
    # Continuous batching: eight requests take about as long as one (50 steps of ~12 ms).
    assert elapsed < 50 * 0.013


async def test_the_prompt_is_counted_when_the_request_does_not_say() -> None:
    async with started() as (engine, _):
        req = EngineRequest(
            request_id="a", prompt="hello there world", prompt_tokens=0, max_tokens=1
        )
        (out,) = await collect(engine, req)
    assert out.prompt_tokens == 3


async def test_same_seed_same_words_and_a_request_seed_changes_them() -> None:
    texts = []
    for seed, req_seed in [(1, None), (1, None), (2, None), (1, 42)]:
        async with started(seed=seed) as (engine, _):
            texts.append("".join(o.text for o in await collect(engine, request(seed=req_seed))))
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]
    assert texts[0] != texts[3]


async def test_abort_ends_the_stream_and_frees_the_engine() -> None:
    async with started() as (engine, _):
        stream = engine.generate(request(max_tokens=1000))
        first = await anext(stream)
        assert not first.finished
        assert engine.snapshot().running == 1
        await engine.abort("a")
        rest = [out async for out in stream]
        assert rest[-1].finished
        assert rest[-1].finish_reason == "abort"
        snapshot = engine.snapshot()
        assert (snapshot.running, snapshot.waiting, snapshot.kv_cache_usage) == (0, 0, 0.0)
        await engine.abort("unknown")  # nothing to do


async def test_a_consumer_that_leaves_early_aborts_its_request() -> None:
    async with started() as (engine, _):
        stream = engine.generate(request(max_tokens=1000))
        await anext(stream)
        await stream.aclose()
        assert engine.snapshot().running == 0


async def test_stop_fails_in_flight_requests_and_leaves_no_task() -> None:
    time = VirtualTime()
    engine = SimulatedEngine(sleep=time.sleep, clock=time.clock)
    await engine.start()
    await engine.start()  # idempotent
    assert len(other_tasks()) == 1
    streaming = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(request(max_tokens=100_000)):
            streaming.set()

    consumer = asyncio.create_task(consume())
    await streaming.wait()
    await engine.stop()
    with pytest.raises(EngineError, match="stopped"):
        await consumer
    assert not other_tasks()
    await engine.stop()  # idempotent
    with pytest.raises(EngineError, match="not running"):
        await collect(engine, request())


async def test_an_idle_engine_waits_without_spinning() -> None:
    async with started() as (engine, time):
        await collect(engine, request())
        before = time.now
        for _ in range(20):
            await asyncio.sleep(0)
        assert time.now == before
        assert len(other_tasks()) == 1  # the engine task, parked
        await collect(engine, request("b"))  # and it wakes for the next request
        assert time.now > before


async def test_refused_requests_raise_request_refused_and_the_engine_carries_on() -> None:
    async with started() as (engine, _):
        with pytest.raises(RequestRefused, match="refused") as refused:
            await collect(engine, EngineRequest("long", "x", 5000, 10))
        assert not isinstance(refused.value, EngineError)  # the worker must not exit on it
        stream = engine.generate(request(max_tokens=100))
        await anext(stream)
        with pytest.raises(RequestRefused, match="already"):
            await collect(engine, request(max_tokens=1))
        await stream.aclose()
        outputs = await collect(engine, request(max_tokens=3))  # still serving
        assert outputs[-1].finished


async def test_a_failed_request_ends_with_finish_reason_error() -> None:
    async with started(SimConfig(faults=SimFaults(error_rate=1.0))) as (engine, _):
        outputs = await collect(engine, request(max_tokens=20))
    assert outputs[-1].finished
    assert outputs[-1].finish_reason == "error"
    assert outputs[-1].error
    assert outputs[-1].completion_tokens < 20


async def test_a_crash_fails_everything_until_restarted() -> None:
    async with started(SimConfig(faults=SimFaults(crash_after_s=0.5))) as (engine, _):
        with pytest.raises(EngineError, match="crash"):
            await collect(engine, request(max_tokens=1000))
        with pytest.raises(EngineError, match="crash"):
            await collect(engine, request("b"))
        with pytest.raises(EngineError):
            engine.snapshot()
        with pytest.raises(EngineError):
            engine.gpu_reading()
        assert not other_tasks()
        await engine.start()  # a fresh engine, its fault clock restarted
        outputs = await collect(engine, request("c", max_tokens=3))
        assert outputs[-1].finish_reason == "length"


async def test_snapshot_limits_and_gpu_reading() -> None:
    config = SimConfig(max_num_seqs=64)
    async with started(config) as (engine, _):
        assert engine.limits == config.limits()
        assert engine.limits.kv_capacity_tokens == 119_184
        stream = engine.generate(request(max_tokens=1000))
        for _ in range(20):
            await anext(stream)
        snapshot = engine.snapshot()
        assert snapshot.running == 1
        assert snapshot.kv_cache_usage == pytest.approx(8 / 7449)  # ≈ 120 tokens: 8 blocks
        # The step in flight (its tokens not yet handed out) already counts.
        assert snapshot.generation_tokens_total in (20, 21)
        assert snapshot.prompt_tokens_total == 100
        assert snapshot.limits.max_num_seqs == 64
        reading = engine.gpu_reading()
        assert reading.simulated
        assert reading.utilization_pct > 0
        assert reading.name == "NVIDIA A100-SXM4-80GB"
        await stream.aclose()


async def test_real_time_by_default() -> None:
    engine = SimulatedEngine()
    await engine.start()
    try:
        outputs = await asyncio.wait_for(collect(engine, request(max_tokens=3)), timeout=10)
    finally:
        await engine.stop()
    assert outputs[-1].finished
    assert not other_tasks()
