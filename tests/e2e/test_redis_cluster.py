"""The stack on a real three-node Redis Cluster (``redis+cluster://``): keys, quotas,
claims, quota hints and WebSocket sessions all work when a tenant's keys and the
request's keys live on different nodes — every script and transaction touches one hash
slot — and the data really is spread over the nodes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
import redis
from websockets.asyncio.client import connect

from schemas import ReplyStatus
from seawall_client import SeawallClient
from tests.rediscluster import redis_cluster
from tests.stack import Stack, launch

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as ports:
        yield ports


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, cluster: list[int]) -> Iterator[Stack]:
    url = f"redis+cluster://127.0.0.1:{cluster[0]}"
    with launch(
        tmp_path_factory.mktemp("stack"), url, "--workers", "1", "--small-workers", "0"
    ) as s:
        yield s


def chat(stack: Stack, key: str, n: int = 1) -> list[int]:
    with httpx.Client(timeout=90) as client:
        return [
            client.post(
                f"{stack.url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={
                    "model": "default",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                },
            ).status_code
            for _ in range(n)
        ]


def test_requests_quotas_and_claims_run_on_the_cluster(stack: Stack, cluster: list[int]) -> None:
    for tier in ("enterprise", "pro"):
        key = stack.key(f"cl-{tier}", tier)["key"]
        assert chat(stack, key, 3) == [200, 200, 200]
    # a basic tenant (a bucket of 20) over its quota: refused, by admission then the edge
    flood = stack.key("cl-basic", "basic")["key"]
    statuses = chat(stack, flood, 30)
    assert statuses.count(200) >= 15
    assert 429 in statuses
    sizes = [redis.Redis(host="127.0.0.1", port=p).dbsize() for p in cluster]
    assert sum(1 for size in sizes if size > 0) >= 2, sizes  # spread over the nodes


async def test_the_sdk_and_a_websocket_session_on_the_cluster(stack: Stack) -> None:
    key = stack.key("cl-sdk", "pro")["key"]
    async with SeawallClient(api_key=key, kafka=stack.settings.kafka) as client:
        reply = await client.complete("hello", max_tokens=5, timeout_s=90)
    assert (reply.status, reply.completion_tokens) == (ReplyStatus.OK, 5)
    url = stack.url.replace("http://", "ws://") + "/v1/ws"
    async with connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        session = json.loads(await asyncio.wait_for(ws.recv(), 30))
        body = {"id": "q", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        await ws.send(json.dumps(body))
        final = json.loads(await asyncio.wait_for(ws.recv(), 90))
    assert session["type"] == "session"
    assert (final["type"], final["id"]) == ("response", "q")
