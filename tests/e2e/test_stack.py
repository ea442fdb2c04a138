"""The whole stack as a user runs it (`seawall up`, every service its own process):
HTTP (JSON and SSE) → ingress → priority topic → admission → dispatch → worker → reply,
and the same from a record on the ingress topic with the producer's own reply topic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest

from schemas import InferenceRequest, ReplyStatus, SamplingParams
from seawall import embedded
from services.common.bus import topics_of
from services.common.settings import CommonSettings
from tests.fleet import ReplyReader, produce


@dataclass(frozen=True)
class Stack:
    proc: subprocess.Popen[str]
    url: str
    env: dict[str, str]
    settings: CommonSettings

    def key(self, tenant: str, tier: str) -> dict[str, str]:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "seawall.cli",
                "keys",
                "create",
                "--tenant",
                tenant,
                "--tier",
                tier,
                "--json",
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        doc: dict[str, str] = json.loads(out.stdout)
        return doc


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("stack")
    ingress_port = embedded.free_port()
    prefix = f"e2e{uuid.uuid4().hex[:6]}."
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEAWALL_")}
    env["SEAWALL_ENV_FILE"] = str(state / "stack.env")
    env["SEAWALL_REDIS_PREFIX"] = f"test:{prefix}"
    argv = [
        sys.executable,
        "-m",
        "seawall.cli",
        "up",
        "--broker-port",
        str(embedded.free_port()),
        "--ingress-port",
        str(ingress_port),
        "--redis",
        redis_url,
        "--topic-prefix",
        prefix,
        "--state-dir",
        str(state),
        "--workers",
        "1",
        "--small-workers",
        "1",
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 150
    for line in proc.stdout:
        seen.append(line)
        if "seawall is up" in line or time.monotonic() > deadline:
            break
    if "seawall is up" not in "".join(seen):
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the stack did not come up:\n" + "".join(seen))
    children = psutil.Process(proc.pid).children(recursive=True)
    settings = CommonSettings(_env_file=str(state / "stack.env"))  # type: ignore[call-arg]
    try:
        yield Stack(proc, f"http://127.0.0.1:{ingress_port}", env, settings)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=90) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], "seawall up left processes behind"


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
    async with ReplyReader(
        stack.settings, topics, owner=f"producer-{uuid.uuid4().hex[:6]}"
    ) as client:
        request = InferenceRequest(
            request_id=f"kafka-{uuid.uuid4().hex[:8]}",
            tenant="ignored-ingress-uses-the-key",
            api_key_id=key["key_id"],
            prompt="summarise the quarter",
            sampling=SamplingParams(max_tokens=10),
            reply_to=client.topic,
            created_at=time.time(),
        )
        await produce(stack.settings, topics.ingress, [request])
        await client.wait_terminals(1, timeout_s=90)
    (reply,) = client.terminals[request.request_id]
    assert reply.status is ReplyStatus.OK
    assert reply.completion_tokens == 10
