"""Ingress's parts, built but not started: for the paths that never reach Redis or
Kafka (were one to, its client would fail: nothing listens on port 1)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from seawall_client.clock import ManualClock
from seawall_client.topics import RedisKeys, Topics
from services.ingress.denials import DenialAudit, FailureLimiter
from services.ingress.keystore import AuditLog, KeyStore
from services.ingress.pipeline import IngressPipeline
from services.ingress.replies import ReplyRouter
from services.ingress.settings import IngressSettings

UNREACHABLE = "127.0.0.1:1"


@dataclass
class Parts:
    settings: IngressSettings
    pipeline: IngressPipeline
    router: ReplyRouter
    clock: ManualClock


@pytest.fixture
async def parts(request: pytest.FixtureRequest, control_keys: Path) -> AsyncIterator[Parts]:
    settings = IngressSettings(
        kafka_bootstrap=UNREACHABLE,
        control_keys_dir=control_keys,
        redis_url=f"redis://{UNREACHABLE}/0",
        region_table={"203.0.113.0/24": "eu-west"},
        models={"default": "main", "tiny": "small"},
        max_output_tokens=1000,
        key_pepper="unit-pepper-0123456789",
        **getattr(request, "param", {}),
    )
    clock = ManualClock()
    topics = Topics()
    redis = aioredis.Redis.from_url(settings.redis_url)
    producer = AIOKafkaProducer(bootstrap_servers=UNREACHABLE)
    audit = AuditLog(producer, topics.audit, "test", clock)
    store = KeyStore(redis, RedisKeys(), settings.pepper, audit, clock=clock)
    denials = DenialAudit(producer, topics.audit, "test", FailureLimiter(1.0, 5), clock)
    pipeline = IngressPipeline(settings, store, denials, producer, topics, redis, clock)
    try:
        yield Parts(settings, pipeline, ReplyRouter(settings, "unit"), clock)
    finally:
        await redis.aclose()
