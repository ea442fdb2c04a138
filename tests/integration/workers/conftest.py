"""sim-serve for real: the simulated engine behind the OpenAI-compatible app, served by
uvicorn on a free port of 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import uvicorn

from seawall.sim_serve import create_app
from services.workers.engine.base import (
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineSnapshot,
)
from services.workers.engine.sim import SimulatedEngine
from services.workers.engine.sim_config import SimConfig

MODEL = "sim-llama-2-7b"


class RecordingEngine:
    """The simulated engine, recording what reaches it through the server (a spy: every
    call goes to the real engine)."""

    name = "sim"

    def __init__(self, engine: SimulatedEngine) -> None:
        self.engine = engine
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.requests.append(request)
        return self.engine.generate(request)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await self.engine.abort(request_id)

    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot()

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits


@dataclass(frozen=True)
class SimServer:
    base_url: str
    engine: RecordingEngine


@asynccontextmanager
async def serve_sim(config: SimConfig | None = None) -> AsyncIterator[SimServer]:
    engine = RecordingEngine(SimulatedEngine(config))
    policy = (config or SimConfig()).scheduling_policy  # as vllm serve, FCFS by default
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(engine, MODEL, policy),
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await eventually(lambda: server.started or task.done())
        if task.done():
            task.result()
        yield SimServer(f"http://127.0.0.1:{port}", engine)
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture
async def sim_server() -> AsyncIterator[SimServer]:
    async with serve_sim() as server:
        yield server


async def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``condition`` holds; fail after ``timeout_s`` (a bound, not a speed claim)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.02)
