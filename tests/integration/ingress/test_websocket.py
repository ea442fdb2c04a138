"""WebSocket sessions (``/v1/ws``) against the running ingress, with a real WebSocket
client (``websockets``): the test plays the downstream (admission and workers) on the
real broker, so it decides when each reply comes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from services.common.settings import CommonSettings
from services.ingress.service import IngressService
from tests.integration.ingress.conftest import Downstream, Keys, ingress_settings

pytestmark = pytest.mark.integration


def url(ingress: IngressService, session_id: str | None = None) -> str:
    query = f"?session_id={session_id}" if session_id else ""
    return f"ws://127.0.0.1:{ingress.port}/v1/ws{query}"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def frame(ws: ClientConnection, timeout_s: float = 20) -> dict[str, Any]:
    data = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
    assert isinstance(data, dict)
    return data


def ask(client_id: str, text: str, stream: bool = False) -> str:
    body = {"id": client_id, "messages": [{"role": "user", "content": text}], "stream": stream}
    return json.dumps(body)


async def test_two_requests_in_flight_on_one_socket_are_answered_each_by_its_id(
    ingress: IngressService, keys: Keys, downstream: Downstream
) -> None:
    async with connect(url(ingress), additional_headers=auth(keys.pro)) as ws:
        session = await frame(ws)
        assert session["type"] == "session"
        assert session["resumed"] is False
        assert (session["idle_timeout_s"], session["max_age_s"], session["ping_s"]) == (
            300.0,
            3600.0,
            30.0,
        )
        await ws.send(ask("a", "first question"))
        await ws.send(ask("b", "second question", stream=True))
        requests = {r.messages[0].content: r for _, _, r in await downstream.take(2)}  # type: ignore[index]
        first, second = requests["first question"], requests["second question"]
        assert first.tenant == second.tenant == "pro-co"  # the key's, as over HTTP
        assert first.session_id == second.session_id == session["session_id"]
        # the second is answered first, in two chunks; then the first
        await downstream.answer(second, "Hello", " there")
        await downstream.answer(first, "Fine")
        frames = [await frame(ws) for _ in range(4)]
    chunks = [f for f in frames if f["type"] == "chunk"]
    assert [(c["id"], c["text"]) for c in chunks] == [("b", "Hello"), ("b", " there")]
    responses = {f["id"]: f for f in frames if f["type"] == "response"}
    assert responses["b"]["response"]["choices"][0]["message"]["content"] == "Hello there"
    assert responses["a"]["response"]["choices"][0]["message"]["content"] == "Fine"
    assert responses["a"]["request_id"] == first.request_id


async def test_a_refused_request_is_an_error_frame_and_the_socket_goes_on(
    ingress: IngressService, keys: Keys, downstream: Downstream
) -> None:
    async with connect(url(ingress), additional_headers=auth(keys.pro)) as ws:
        await frame(ws)
        await ws.send(json.dumps({"id": "x", "messages": [], "model": "gpt-9"}))
        await ws.send("{not json")
        bad_model, bad_json = await frame(ws), await frame(ws)
        await ws.send(ask("ok", "still here?"))
        ((_, _, request),) = await downstream.take(1)
        await downstream.answer(request, "yes")
        ok = await frame(ws)
    assert (bad_model["type"], bad_model["id"], bad_model["status"]) == ("error", "x", 400)
    assert bad_json["error"]["code"] == "invalid_json"
    assert (ok["type"], ok["id"]) == ("response", "ok")


async def test_a_frame_over_the_request_limit_is_refused_before_it_is_parsed(
    ingress: IngressService, keys: Keys, downstream: Downstream
) -> None:
    """One limit on every edge: a frame over it is answered 413 whatever it holds — valid
    JSON or not, it is not parsed — and the socket goes on. Non-ASCII text within the
    limit passes (it is not escaped into a larger body)."""
    limit = ingress.settings.max_request_bytes
    async with connect(url(ingress), additional_headers=auth(keys.pro)) as ws:
        await frame(ws)
        await ws.send(ask("big", "x" * limit))
        await ws.send("{" + "x" * limit)  # not JSON: still refused for its size
        big, broken = await frame(ws), await frame(ws)
        near = "密" * ((limit - 200) // 3)  # 3 bytes each in UTF-8, 6 once escaped
        body = {"id": "near", "messages": [{"role": "user", "content": near}]}
        await ws.send(json.dumps(body, ensure_ascii=False))
        ((_, _, request),) = await downstream.take(1)
        await downstream.answer(request, "ok")
        ok = await frame(ws)
    for refused in (big, broken):
        assert (refused["type"], refused["status"]) == ("error", 413)
        assert refused["error"]["code"] == "body_too_large"
        assert refused["id"] is None
    assert (ok["type"], ok["id"]) == ("response", "near")
    assert request.messages is not None
    assert request.messages[0].content == near


async def test_a_bad_key_is_refused_with_1008(ingress: IngressService) -> None:
    async with connect(url(ingress), additional_headers=auth("sk-nope")) as ws:
        refusal = await frame(ws)
        with pytest.raises(ConnectionClosed) as closed:
            await frame(ws)
    assert refusal["type"] == "error"
    assert refusal["status"] == 401
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1008


@pytest.mark.parametrize("ingress", [{"ws_idle_timeout_s": 1.0}], indirect=True)
async def test_an_idle_socket_is_closed_with_4001(ingress: IngressService, keys: Keys) -> None:
    async with connect(url(ingress), additional_headers=auth(keys.pro)) as ws:
        assert (await frame(ws))["idle_timeout_s"] == 1.0
        with pytest.raises(ConnectionClosed) as closed:
            await frame(ws, timeout_s=10)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4001


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One server frame off the raw socket (RFC 6455, unmasked): opcode, payload."""
    head = await reader.readexactly(2)
    size = head[1] & 0x7F
    if size == 126:
        size = int.from_bytes(await reader.readexactly(2))
    elif size == 127:
        size = int.from_bytes(await reader.readexactly(8))
    return head[0] & 0x0F, await reader.readexactly(size)


@pytest.mark.parametrize("ingress", [{"ws_ping_s": 0.5}], indirect=True)
async def test_the_server_pings_and_drops_a_client_that_never_answers(
    ingress: IngressService, keys: Keys
) -> None:
    """A raw socket, so that nothing answers the pings for the test: the server pings
    every ``ws_ping_s`` and closes the connection of a client that stays silent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", ingress.port)
    try:
        nonce = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            (
                "GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {nonce}\r\n"
                f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {keys.pro}\r\n\r\n"
            ).encode()
        )
        status = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert status.startswith(b"HTTP/1.1 101")
        opcodes = []
        async with asyncio.timeout(20):
            while True:
                try:
                    opcode, _ = await read_frame(reader)
                except asyncio.IncompleteReadError:
                    break  # the server closed the connection
                opcodes.append(opcode)
                if opcode == 0x8:
                    break
    finally:
        writer.close()
    assert opcodes[0] == 0x1  # the session frame
    assert 0x9 in opcodes  # a ping, which nobody answered: then the server hung up


async def busy(ws: ClientConnection) -> None:
    """Send and read without pause, until the server closes the socket."""
    while True:
        await ws.send("{}")
        await frame(ws, timeout_s=10)


@pytest.mark.parametrize("ingress", [{"ws_max_age_s": 2.0}], indirect=True)
async def test_a_session_ends_at_its_max_age_with_4002(ingress: IngressService, keys: Keys) -> None:
    async with connect(url(ingress), additional_headers=auth(keys.pro)) as ws:
        await frame(ws)
        with pytest.raises(ConnectionClosed) as closed:
            await busy(ws)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4002


async def test_a_reconnect_with_the_session_id_receives_the_reply_owed(
    ingress: IngressService, keys: Keys, downstream: Downstream
) -> None:
    async with connect(url(ingress), additional_headers=auth(keys.enterprise)) as ws:
        session_id = (await frame(ws))["session_id"]
        await ws.send(ask("late", "answer me after I leave"))
        ((_, _, request),) = await downstream.take(1)
    # the client is gone; the reply comes now, and one more after the reconnect
    await downstream.answer(request, "kept for you")
    async with connect(url(ingress, session_id), additional_headers=auth(keys.enterprise)) as ws:
        resumed = await frame(ws)
        owed = await frame(ws)
    assert (resumed["type"], resumed["session_id"], resumed["resumed"]) == (
        "session",
        session_id,
        True,
    )
    assert (owed["type"], owed["id"], owed["request_id"]) == (
        "response",
        "late",
        request.request_id,
    )
    assert owed["response"]["choices"][0]["message"]["content"] == "kept for you"
    # another tenant cannot take over the session
    async with connect(url(ingress, session_id), additional_headers=auth(keys.pro)) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await frame(ws)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4004


async def test_a_reconnect_to_another_replica_receives_the_reply_owed(
    ingress: IngressService, keys: Keys, downstream: Downstream, settings: CommonSettings
) -> None:
    """The session lives in Redis, not in the replica that opened it: the reply owed
    when the socket left reaches the client on whichever replica it comes back to."""
    async with connect(url(ingress), additional_headers=auth(keys.pro)) as ws:
        session_id = (await frame(ws))["session_id"]
        await ws.send(ask("roaming", "answer me wherever I am"))
        ((_, _, request),) = await downstream.take(1)
    await downstream.answer(request, "found you")  # reaches the first replica only
    other = IngressService(ingress_settings(settings, instance_id="ingress-other"))
    async with (
        other,
        connect(url(other, session_id), additional_headers=auth(keys.pro)) as ws,
    ):
        resumed = await frame(ws)
        owed = await frame(ws)
    assert (resumed["session_id"], resumed["resumed"]) == (session_id, True)
    assert (owed["id"], owed["request_id"]) == ("roaming", request.request_id)
    assert owed["response"]["choices"][0]["message"]["content"] == "found you"


async def test_a_reply_that_comes_after_the_reconnect_is_delivered_too(
    ingress: IngressService, keys: Keys, downstream: Downstream
) -> None:
    async with connect(url(ingress), additional_headers=auth(keys.pro)) as ws:
        session_id = (await frame(ws))["session_id"]
        await ws.send(ask("slow", "take your time"))
        ((_, _, request),) = await downstream.take(1)
    async with connect(url(ingress, session_id), additional_headers=auth(keys.pro)) as ws:
        assert (await frame(ws))["resumed"] is True
        await downstream.answer(request, "done")  # reaches the old socket's wait, owed
        owed = await frame(ws)
    assert (owed["id"], owed["response"]["choices"][0]["message"]["content"]) == ("slow", "done")
