"""WebSocket sessions through the whole stack (``seawall up``, simulated engines): two
requests in flight on one socket, a reconnect that collects the reply owed to a socket
that left, and the idle close (shortened to 3 s here)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.stack import Stack, launch

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    with launch(
        tmp_path_factory.mktemp("ws"),
        redis_url,
        "--workers",
        "1",
        "--small-workers",
        "0",
        env={"SEAWALL_WS_IDLE_TIMEOUT_S": "3"},
    ) as s:
        yield s


def ws_url(stack: Stack, session_id: str | None = None) -> str:
    query = f"?session_id={session_id}" if session_id else ""
    return stack.url.replace("http://", "ws://") + "/v1/ws" + query


async def frame(ws: ClientConnection, timeout_s: float = 60) -> dict[str, Any]:
    data = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
    assert isinstance(data, dict)
    return data


def body(client_id: str, max_tokens: int, stream: bool = False) -> str:
    return json.dumps(
        {
            "id": client_id,
            "model": "default",
            "messages": [{"role": "user", "content": f"question {client_id}"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    )


async def test_two_requests_in_flight_then_the_idle_close(stack: Stack) -> None:
    key = stack.key("ws-pro", "pro")["key"]
    headers = {"Authorization": f"Bearer {key}"}
    async with connect(ws_url(stack), additional_headers=headers) as ws:
        assert (await frame(ws))["type"] == "session"
        await ws.send(body("long", 40, stream=True))
        await ws.send(body("short", 4))
        finals: dict[str, dict[str, Any]] = {}
        chunks: list[str] = []
        while len(finals) < 2:
            f = await frame(ws)
            if f["type"] == "chunk":
                assert f["id"] == "long"
                chunks.append(f["text"])
            else:
                assert f["type"] == "response", f
                finals[f["id"]] = f
        long_text = finals["long"]["response"]["choices"][0]["message"]["content"]
        assert "".join(chunks) == long_text
        assert finals["long"]["response"]["usage"]["completion_tokens"] == 40
        assert finals["short"]["response"]["usage"]["completion_tokens"] == 4
        # nothing in flight and nothing sent: closed after the idle timeout
        with pytest.raises(ConnectionClosed) as closed:
            await frame(ws, timeout_s=30)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4001


async def test_a_reconnect_collects_the_reply_owed_to_the_socket_that_left(stack: Stack) -> None:
    key = stack.key("ws-vip", "enterprise")["key"]
    headers = {"Authorization": f"Bearer {key}"}
    async with connect(ws_url(stack), additional_headers=headers) as ws:
        session_id = (await frame(ws))["session_id"]
        await ws.send(body("later", 60))
        await asyncio.sleep(0.5)  # sent on its way; the client leaves before the answer
    async with connect(ws_url(stack, session_id), additional_headers=headers) as ws:
        resumed = await frame(ws)
        owed = await frame(ws)
    assert (resumed["session_id"], resumed["resumed"]) == (session_id, True)
    assert (owed["type"], owed["id"]) == ("response", "later")
    assert owed["response"]["usage"]["completion_tokens"] == 60
