"""Idle HTTP/1.1 connections stay open for ``http_keep_alive_s``, longer than a load
balancer keeps its own (a backend that closes first resets the balancer's next
request), and are closed after it."""

from __future__ import annotations

import asyncio

import pytest

from services.ingress.service import IngressService

pytestmark = pytest.mark.integration

REQUEST = b"GET /health HTTP/1.1\r\nHost: ingress\r\n\r\n"


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(REQUEST)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await asyncio.wait_for(reader.readexactly(length), 10)
    return head.split(b"\r\n", 1)[0]


async def test_an_idle_connection_outlives_uvicorns_default_of_five_seconds(
    ingress: IngressService,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", ingress.port)
    try:
        assert await exchange(reader, writer) == b"HTTP/1.1 200 OK"
        await asyncio.sleep(6)
        assert await exchange(reader, writer) == b"HTTP/1.1 200 OK"  # the same socket
    finally:
        writer.close()


@pytest.mark.parametrize("ingress", [{"http_keep_alive_s": 1}], indirect=True)
async def test_an_idle_connection_is_closed_after_the_keep_alive(ingress: IngressService) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", ingress.port)
    try:
        assert await exchange(reader, writer) == b"HTTP/1.1 200 OK"
        assert await asyncio.wait_for(reader.read(1), 10) == b""  # closed by the server
    finally:
        writer.close()
