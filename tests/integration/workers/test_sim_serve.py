"""sim-serve over HTTP: the OpenAI-compatible endpoints, SSE streaming, /metrics, and
aborts on client disconnect, against the simulated engine."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from seawall.sim_serve import create_app
from services.common.tokenizer import count_tokens
from services.workers.engine.sim import SimulatedEngine
from services.workers.engine.sim_config import SimConfig, SimFaults
from tests.integration.workers.conftest import MODEL, SimServer, eventually, serve_sim

pytestmark = pytest.mark.integration

PROMPT = "Where is my order? It was due last week."


@pytest.fixture
async def client(sim_server: SimServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim_server.base_url, timeout=30) as client:
        yield client


def _words(text: str) -> int:
    """The simulated engine writes one word per token."""
    return len(text.split())


async def _events(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of an SSE body, ``[DONE]`` kept as a string."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


async def test_health_and_models(client: httpx.AsyncClient, sim_server: SimServer) -> None:
    assert (await client.get("/health")).status_code == 200
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == sim_server.engine.limits.max_model_len


async def test_a_crashed_engine_fails_health_and_metrics() -> None:
    async with (
        serve_sim(SimConfig(faults=SimFaults(crash_after_s=0.0))) as server,
        httpx.AsyncClient(base_url=server.base_url) as client,
    ):
        assert (await client.get("/health")).status_code == 503
        metrics = await client.get("/metrics")
        assert metrics.status_code == 503
        assert "crash" in metrics.text


async def test_completion(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6}
    )
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert _words(choice["text"]) == 6
    assert body["usage"] == {
        "prompt_tokens": count_tokens(PROMPT),
        "completion_tokens": 6,
        "total_tokens": count_tokens(PROMPT) + 6,
    }


async def test_completion_stream_with_continuous_usage(client: httpx.AsyncClient) -> None:
    async with client.stream(
        "POST",
        "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = await _events(response)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk, _ = events
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "length"
    ]
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion)
    assert completion[-1] == 5
    assert _words("".join(c["choices"][0]["text"] for c in chunks)) == 5
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 5
    assert usage_chunk["usage"]["prompt_tokens"] == count_tokens(PROMPT)


async def test_completion_stream_without_usage(client: httpx.AsyncClient) -> None:
    async with client.stream(
        "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}
    ) as response:
        events = await _events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_completion(client: httpx.AsyncClient, sim_server: SimServer) -> None:
    messages = [
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": [{"type": "text", "text": "Where is my order?"}]},
    ]
    response = await client.post(
        "/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 4}
    )
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert _words(choice["message"]["content"]) == 4
    assert choice["finish_reason"] == "length"
    prompt = sim_server.engine.requests[-1].prompt
    assert prompt == "system: You are a support agent.\nuser: Where is my order?\nassistant:"
    assert body["usage"]["prompt_tokens"] == count_tokens(prompt)


async def test_chat_stream_opens_with_the_role(client: httpx.AsyncClient) -> None:
    async with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    ) as response:
        events = await _events(response)
    first, *chunks, done = events
    assert done == "[DONE]"
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert _words(text) == 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_without_max_tokens_fills_the_context(
    client: httpx.AsyncClient, sim_server: SimServer
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    async with client.stream(
        "POST", "/v1/chat/completions", json={"messages": messages, "stream": True}
    ) as response:
        assert response.status_code == 200  # leaving at once aborts the long request
    request = sim_server.engine.requests[-1]
    assert request.prompt_tokens + request.max_tokens == sim_server.engine.limits.max_model_len


async def test_sampling_settings_reach_the_engine(
    client: httpx.AsyncClient, sim_server: SimServer
) -> None:
    response = await client.post(
        "/v1/completions",
        headers={"X-Request-Id": "req-42"},
        json={
            "prompt": PROMPT,
            "max_tokens": 2,
            "temperature": 0.2,
            "top_p": 0.9,
            "stop": "\n",
            "seed": 7,
        },
    )
    assert response.json()["id"] == "cmpl-req-42"
    request = sim_server.engine.requests[-1]
    assert (request.request_id, request.temperature, request.top_p) == ("req-42", 0.2, 0.9)
    assert (request.stop, request.seed, request.priority) == (("\n",), 7, 0)


async def test_priorities_as_vllm_serve_takes_them_under_each_scheduling_policy() -> None:
    """FCFS (vLLM's default) refuses a non-zero priority with vLLM's own 400; the
    priority policy hands it to the engine."""
    body = {"prompt": PROMPT, "max_tokens": 2, "priority": -3}
    async with serve_sim() as fcfs, httpx.AsyncClient(base_url=fcfs.base_url) as client:
        refused = await client.post("/v1/completions", json=body)
        plain = await client.post("/v1/completions", json={**body, "priority": 0})
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert message == "Got priority -3 but Priority scheduling is not enabled."
    assert plain.status_code == 200
    async with (
        serve_sim(SimConfig(scheduling_policy="priority")) as server,
        httpx.AsyncClient(base_url=server.base_url) as client,
    ):
        taken = await client.post("/v1/completions", json=body)
    assert taken.status_code == 200
    assert server.engine.requests[-1].priority == -3


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/completions", b"{", 400, "not valid JSON"),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n=1"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": ""}, 400, "empty"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "context length"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages",
        ),
    ],
)
async def test_bad_requests_get_openai_errors(
    client: httpx.AsyncClient, path: str, body: Any, status: int, message: str
) -> None:
    if isinstance(body, bytes):
        response = await client.post(path, content=body)
    else:
        response = await client.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == status


def _samples(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels.get("le")
    }


async def test_metrics_carry_vllm_names(client: httpx.AsyncClient) -> None:
    before = _samples((await client.get("/metrics")).text)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in before, name
    await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True})
    after = _samples((await client.get("/metrics")).text)
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert after[f"{histogram}_count"] == before[f"{histogram}_count"] + 2
        assert after[f"{histogram}_sum"] > before[f"{histogram}_sum"]
    assert after["vllm:generation_tokens_total"] >= before["vllm:generation_tokens_total"] + 8
    assert after["vllm:num_requests_running"] == 0


def test_each_app_has_its_own_registry() -> None:
    first = create_app(SimulatedEngine(), "a")
    second = create_app(SimulatedEngine(), "b")
    assert first.state.metrics_registry is not second.state.metrics_registry
    global_names = {
        sample.name for family in prometheus_client.REGISTRY.collect() for sample in family.samples
    }
    assert not any(name.startswith("vllm:") for name in global_names)


async def test_stream_disconnect_aborts_the_request(
    client: httpx.AsyncClient, sim_server: SimServer
) -> None:
    async with client.stream(
        "POST",
        "/v1/completions",
        headers={"X-Request-Id": "leaver"},
        json={"prompt": PROMPT, "max_tokens": 3000, "stream": True},
    ) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # one token is enough; leaving the block closes the connection
    await eventually(lambda: "leaver" in sim_server.engine.aborted)
    await eventually(lambda: sim_server.engine.snapshot().running == 0)


async def test_disconnect_during_a_plain_request_aborts_it(
    client: httpx.AsyncClient, sim_server: SimServer
) -> None:
    with pytest.raises(httpx.ReadTimeout):
        await client.post(
            "/v1/completions",
            headers={"X-Request-Id": "impatient"},
            json={"prompt": PROMPT, "max_tokens": 3000},
            timeout=httpx.Timeout(30, read=0.5),
        )
    await eventually(lambda: "impatient" in sim_server.engine.aborted)
    await eventually(lambda: sim_server.engine.snapshot().running == 0)


async def test_finished_requests_are_not_aborted(
    client: httpx.AsyncClient, sim_server: SimServer
) -> None:
    await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True})
    assert sim_server.engine.aborted == []
