"""Ingress in process on the real broker and Redis (HTTP on a free port of 127.0.0.1),
and the parts around it: a downstream that reads the priority topics and answers on
the request's reply topic, and keys of each tier in the key store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas import InferenceReply, InferenceRequest, Priority, ReplyChunk, ReplyStatus, Tier
from schemas.base import Message
from seawall_client.clock import ManualClock
from seawall_client.serde import REQUEST, decode, encode
from seawall_client.topics import RedisKeys, Topics
from services.common.bus import make_consumer, make_producer
from services.common.sensitive import SensitivePolicy
from services.common.settings import CommonSettings
from services.ingress.keystore import AuditLog, KeyStore
from services.ingress.policy.keys import DAY_S
from services.ingress.service import IngressService
from services.ingress.settings import IngressSettings


def ingress_settings(settings: CommonSettings, **changes: object) -> IngressSettings:
    base = settings.model_dump()
    base.update(
        ingress_port=0,
        shutdown_grace_s=3,
        key_pepper="test-pepper-0123456789",
        region_table={"203.0.113.0/24": "eu-west", "198.51.100.0/24": "ap-east"},
        # The test client connects from 127.0.0.1: it plays a trusted proxy, whose
        # X-Forwarded-For entries name the client.
        trusted_proxies=("127.0.0.1/32",),
        models={"default": "main", "small-model": "small"},
        kafka_ingress=False,  # joining its group takes seconds here; on where tested
    )
    base.update(changes)
    return IngressSettings(**base)


@pytest.fixture
async def ingress(
    settings: CommonSettings, topics: Topics, request: pytest.FixtureRequest
) -> AsyncIterator[IngressService]:
    service = IngressService(ingress_settings(settings, **getattr(request, "param", {})))
    async with service:
        yield service


@pytest.fixture
async def client(ingress: IngressService) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ingress.port}", timeout=30) as c:
        yield c


@dataclass(frozen=True)
class Keys:
    """One key per tier, and one per sensitive policy, with their tenants."""

    basic: str
    pro: str
    enterprise: str
    blocking: str
    """Enterprise tenant whose policy blocks sensitive data."""

    @staticmethod
    def auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}


async def new_key(
    store: KeyStore, tenant: str, tier: Tier, sensitive: SensitivePolicy = "redact"
) -> str:
    issued, _ = await store.create(tenant, tier=tier, sensitive=sensitive)
    return issued.key


@dataclass(frozen=True)
class Streamed:
    """A streamed chat answer as the client saw it: its status, its headers and its
    server-sent ``data:`` lines."""

    status: int
    headers: httpx.Headers
    events: list[str]


async def stream_chat(
    port: int, headers: dict[str, str], max_tokens: int, timeout_s: float = 60
) -> Streamed:
    """A streamed chat request (a haiku about the sea) to the ingress on ``port``."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Write a haiku about the sea"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    async with (
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=timeout_s) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
    ):
        events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    return Streamed(response.status_code, response.headers, events)


@pytest.fixture
async def keys(ingress: IngressService) -> Keys:
    store = ingress.keystore
    return Keys(
        basic=await new_key(store, "basic-co", Tier.BASIC),
        pro=await new_key(store, "pro-co", Tier.PRO),
        enterprise=await new_key(store, "big-co", Tier.ENTERPRISE),
        blocking=await new_key(store, "careful-co", Tier.ENTERPRISE, "block"),
    )


@pytest.fixture
async def backdated(
    ingress: IngressService, redis: aioredis.Redis
) -> AsyncIterator[Callable[[str, float], Awaitable[str]]]:
    """Creates keys as if ``days`` ago (for keys in their grace period, retired, ...)."""
    producer = make_producer(ingress.settings)
    await producer.start()

    async def create(tenant: str, days: float) -> str:
        store = KeyStore(
            redis,
            RedisKeys(ingress.settings.redis_prefix),
            ingress.settings.pepper,
            AuditLog(producer, ingress.topics.audit, "test"),
            clock=ManualClock(time.time() - days * DAY_S),
        )
        return await new_key(store, tenant, Tier.PRO)

    try:
        yield create
    finally:
        await producer.stop()


Seen = tuple[str, bytes | None, InferenceRequest]
"""A request on a priority topic: the topic, the record key, the request."""


class Downstream:
    """Plays admission and workers: reads the priority topics, answers on reply topics."""

    def __init__(self, settings: CommonSettings, topics: Topics) -> None:
        self._settings = settings
        self._topics = topics
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self.seen: list[Seen] = []

    async def __aenter__(self) -> Downstream:
        self._consumer = make_consumer(
            self._settings,
            *(self._topics.requests(p) for p in Priority),
            group_id=None,
        )
        self._producer = make_producer(self._settings)
        await self._consumer.start()
        await self._producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._consumer is not None
        assert self._producer is not None
        await self._consumer.stop()
        await self._producer.stop()

    async def poll(self, timeout_ms: int = 200) -> None:
        assert self._consumer is not None
        for records in (await self._consumer.getmany(timeout_ms=timeout_ms)).values():
            for r in records:
                self.seen.append((r.topic, r.key, decode(REQUEST, r.value)))

    async def take(
        self, n: int = 1, timeout_s: float = 20
    ) -> list[tuple[str, bytes | None, InferenceRequest]]:
        """Wait until ``n`` requests (in all) have arrived; the first ``n``."""
        deadline = time.monotonic() + timeout_s
        while len(self.seen) < n and time.monotonic() < deadline:
            await self.poll()
        assert len(self.seen) >= n, f"{len(self.seen)} of {n} requests on the priority topics"
        return self.seen[:n]

    async def send(self, topic: str, *messages: Message, key: str) -> None:
        assert self._producer is not None
        for msg in messages:
            await self._producer.send_and_wait(topic, encode(msg), key=key.encode())

    async def answer(
        self,
        request: InferenceRequest,
        *chunks: str,
        status: ReplyStatus = ReplyStatus.OK,
        **reply: object,
    ) -> None:
        """Chunks (each text one chunk), then the terminal reply."""
        rid = request.request_id
        msgs: list[Message] = [
            ReplyChunk(request_id=rid, seq=i, text=text, tokens=1) for i, text in enumerate(chunks)
        ]
        fields: dict[str, object] = {
            "text": "".join(chunks),
            "prompt_tokens": 5,
            "completion_tokens": len(chunks),
            "finish_reason": "stop",
            "chunks": len(chunks),
        }
        fields.update(reply)
        msgs.append(
            InferenceReply(request_id=rid, status=status, completed_at=time.time(), **fields)
        )
        await self.send(request.reply_to, *msgs, key=rid)


@pytest.fixture
async def downstream(settings: CommonSettings, topics: Topics) -> AsyncIterator[Downstream]:
    async with Downstream(settings, topics) as d:
        yield d


async def eventually(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)
