"""A webhook receiver for the alert notifiers' tests: a real HTTP server on a free port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web


@dataclass
class Hook:
    url: str
    bodies: list[dict[str, object]] = field(default_factory=list)
    fail_first: int = 0
    hang: bool = False
    """Hold every request until the test ends."""
    released: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def hook() -> AsyncIterator[Hook]:
    state = Hook("")

    async def receive(request: web.Request) -> web.Response:
        if state.hang:
            await state.released.wait()
        if state.fail_first > 0:
            state.fail_first -= 1
            return web.Response(status=500)
        state.bodies.append(await request.json())
        state.arrived.set()
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.url = f"http://127.0.0.1:{port}/hook"
    yield state
    state.released.set()
    await runner.cleanup()
