"""What the broker-fronting test servers share (``TlsTerminator`` in
``tests.integration.test_kafka_security``, ``tests.sasl_proxy.SaslFront``): a listening
socket whose connections each get a relay task, all cancelled on exit, and the byte
pipe between two streams; and writing one record and reading back a topic's first."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, Self

from aiokafka import TopicPartition

from seawall_client.kafka import KafkaConfig, close, new_consumer, new_producer


class RelayServer:
    """Listens on ``port`` (with ``ssl`` where given) and runs ``relay`` for each
    connection until it ends or the server exits."""

    def __init__(self, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self.port = port
        self._ssl = ssl_context
        self._server: asyncio.Server | None = None
        self._relays: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, ssl=self._ssl
        )
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for relay in list(self._relays):
            relay.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._relays.add(task)
        try:
            await self.relay(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            self._relays.discard(task)
            writer.close()

    async def relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until either end closes."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def write_one(config: KafkaConfig, topic: str, value: bytes, key: bytes) -> None:
    """One record onto ``topic``, written with ``config`` and acknowledged."""
    producer = new_producer(config)
    try:
        await producer.start()
        await producer.send_and_wait(topic, value, key=key)
    finally:
        await close(producer)


async def read_one(config: KafkaConfig, topic: str) -> Any:
    """The first record of ``topic``'s partition 0, read with ``config``."""
    consumer = new_consumer(config, group_id=None)
    try:
        await consumer.start()
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        return await asyncio.wait_for(consumer.getone(), timeout=20)
    finally:
        await close(consumer)
