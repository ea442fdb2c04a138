"""An OpenAI-compatible server around any ``base.Engine``, like llm-d's inference simulator.

Put the simulated engine behind it and it stands in for ``vllm serve``: the same
endpoints (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``), the
same streaming format (server-sent events of OpenAI chunks, then ``data: [DONE]``,
with vLLM's ``stream_options.continuous_usage_stats``) and the same Prometheus names
on ``/metrics``, so the OpenAI-HTTP engine and anything scraping vLLM work against it
unchanged. The gauges are read from ``engine.snapshot()`` at scrape time; the latency
histograms are observed per request, here.

Chat messages are flattened to one prompt (``role: content`` lines, then
``assistant:``): the engine sees text, not a chat template.

A client that disconnects has its request aborted in the engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import Receive, Scope, Send

from services.common.openai_shapes import (
    SSE_DONE,
    OneChoice,
    OnePrompt,
    TextPart,
    chunk_object,
    completion_id,
    content_text,
    envelope,
    sse,
    usage,
)
from services.common.tokenizer import count_tokens
from services.workers.engine.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    FinishReason,
)
from services.workers.engine.sim_config import SchedulingPolicy

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read the same.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


# --- request bodies ------------------------------------------------------------------


class _StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(OneChoice):
    """The fields both endpoints share; unknown OpenAI fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    priority: int = 0
    """vLLM's extension: lower runs first."""

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class _CompletionBody(_Sampling, OnePrompt):
    max_tokens: int | None = Field(16, ge=1)


class _Message(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        return content_text(self.content)


class _ChatBody(_Sampling):
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def text(self) -> str:
        lines = [f"{message.role}: {message.text()}" for message in self.messages]
        return "\n".join([*lines, "assistant:"])


# --- responses -----------------------------------------------------------------------


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _error(message: str, status: int) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


@dataclass(frozen=True, slots=True)
class _Job:
    """One accepted request: what the engine runs and how the answer is shaped."""

    request: EngineRequest
    chat: bool
    model: str
    created: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    arrival: float
    """``time.monotonic()`` when the request came in, for the latency histograms."""

    @property
    def id(self) -> str:
        return completion_id(self.chat, self.request.request_id)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return envelope(self.id, obj, self.created, self.model, choices)

    def opening_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        if not self.chat:
            return None
        return self._envelope(
            "chat.completion.chunk",
            [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}],
        )

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(chunk_object(self.chat), []), "usage": usage}

    def response(self, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            return {**self._envelope("chat.completion", [choice]), "usage": usage}
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        return {**self._envelope("text_completion", [choice]), "usage": usage}


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its generator however the response ends.

    Starlette cancels a stream whose client went away; if that happens while the
    generator waits at a ``yield`` it would otherwise stay suspended until garbage
    collection, and its ``finally`` (which aborts the engine request) would run late.
    """

    def __init__(self, content: AsyncGenerator[str, None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._generator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._generator.aclose()


# --- metrics -------------------------------------------------------------------------


class _SnapshotCollector(Collector):
    """vLLM's scheduler gauges and counters, read from the engine at scrape time."""

    def __init__(self, engine: Engine, model: str) -> None:
        self._engine = engine
        self._model = model

    def collect(self) -> Iterable[Metric]:
        snapshot = self._engine.snapshot()
        figures: list[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, float]] = [
            (
                GaugeMetricFamily,
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                snapshot.running,
            ),
            (
                GaugeMetricFamily,
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                snapshot.waiting,
            ),
            (
                GaugeMetricFamily,
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                snapshot.kv_cache_usage,
            ),
            (
                CounterMetricFamily,
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                snapshot.preempted_total,
            ),
            (
                CounterMetricFamily,
                "vllm:prompt_tokens",
                "Number of prefill tokens processed.",
                snapshot.prompt_tokens_total,
            ),
            (
                CounterMetricFamily,
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                snapshot.generation_tokens_total,
            ),
        ]
        for family_type, name, documentation, value in figures:
            family = family_type(name, documentation, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family


class _Metrics:
    def __init__(self, engine: Engine, model: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(engine, model))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labelnames=["model_name"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labelnames=["model_name"],
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model)


class _RequestTimer:
    """Observes one request's time to first token and end-to-end latency, once each."""

    def __init__(self, metrics: _Metrics, arrival: float) -> None:
        self._metrics = metrics
        self._start = arrival
        self._first = False

    def output(self, out: EngineOutput) -> None:
        if not self._first and out.new_tokens > 0:
            self._first = True
            self._metrics.ttft.observe(time.monotonic() - self._start)
        if out.finished and out.finish_reason != "error":
            self._metrics.e2e.observe(time.monotonic() - self._start)


# --- the app -------------------------------------------------------------------------


def create_app(
    engine: Engine, model_name: str, scheduling_policy: SchedulingPolicy = "fcfs"
) -> FastAPI:
    """The server for ``engine``, answering as model ``model_name``.

    The app starts and stops the engine with its lifespan. Prompts are sized with the
    simulated engine's token counter, for the engine's KV accounting and the
    context-length check. ``scheduling_policy`` is ``vllm serve``'s: under ``fcfs`` (its
    default) a request with a non-zero ``priority`` is refused with vLLM's 400.
    """
    metrics = _Metrics(engine, model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="seawall sim-serve", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine answers, 503 once it has failed (as ``vllm serve``)."""
        try:
            engine.snapshot()
        except EngineError:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "seawall",
                    "max_model_len": engine.limits.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """503 once the engine has failed: its figures are gone, and zeros would lie."""
        try:
            text = generate_latest(metrics.registry)
        except EngineError as exc:
            return Response(str(exc), status_code=503, media_type="text/plain")
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, chat=True)

    async def _serve(request: Request, *, chat: bool) -> Response:
        arrival = time.monotonic()
        try:
            job = _job(await _body(request, chat), request, chat, arrival)
        except _BadRequest as exc:
            return JSONResponse(_error(str(exc), exc.status), status_code=exc.status)
        if job.stream:
            return _ClosingStreamingResponse(_stream(job))
        return await _complete(job, request)

    def _job(
        body: _CompletionBody | _ChatBody, request: Request, chat: bool, arrival: float
    ) -> _Job:
        if body.model is not None and body.model != model_name:
            raise _BadRequest(f"The model `{body.model}` does not exist.", 404)
        prompt = body.text()
        if not prompt:
            raise _BadRequest("The prompt is empty.")
        prompt_tokens = count_tokens(prompt)
        max_model_len = engine.limits.max_model_len
        if isinstance(body, _ChatBody):
            max_tokens = body.max_completion_tokens or body.max_tokens
        else:
            max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - prompt_tokens
        if max_tokens < 1 or prompt_tokens + max_tokens > max_model_len:
            raise _BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"prompt, {max_tokens} in the completion)."
            )
        if body.priority != 0 and scheduling_policy != "priority":
            # vLLM's own check (its engine's add_request), answered 400 by its server.
            raise _BadRequest(
                f"Got priority {body.priority} but Priority scheduling is not enabled."
            )
        options = body.stream_options or _StreamOptions()
        return _Job(
            request=EngineRequest(
                request_id=request.headers.get("x-request-id") or uuid.uuid4().hex,
                prompt=prompt,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                stop=body.stops(),
                priority=body.priority,
                seed=body.seed,
            ),
            chat=chat,
            model=model_name,
            created=int(time.time()),
            stream=body.stream,
            include_usage=options.include_usage,
            continuous_usage=options.continuous_usage_stats,
            arrival=arrival,
        )

    async def _complete(job: _Job, request: Request) -> Response:
        """Run a request to its end; abort it if the client leaves first."""
        timer = _RequestTimer(metrics, job.arrival)
        watcher = asyncio.create_task(_abort_on_disconnect(request, job.request.request_id))
        parts: list[str] = []
        final: EngineOutput | None = None
        try:
            async for out in engine.generate(job.request):
                timer.output(out)
                parts.append(out.text)
                final = out
        except EngineError as exc:
            return JSONResponse(_error(str(exc), 500), status_code=500)
        finally:
            watcher.cancel()
        if final is None or not final.finished:
            return JSONResponse(_error("the engine ended without finishing", 500), 500)
        if final.finish_reason == "error":
            return JSONResponse(_error(final.error or "the engine failed", 500), 500)
        tokens = usage(final.prompt_tokens or job.request.prompt_tokens, final.completion_tokens)
        return JSONResponse(job.response("".join(parts), _finish(final), tokens))

    async def _abort_on_disconnect(request: Request, request_id: str) -> None:
        # The body has been read, so the next message is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        await engine.abort(request_id)

    async def _stream(job: _Job) -> AsyncGenerator[str, None]:
        timer = _RequestTimer(metrics, job.arrival)
        outputs = engine.generate(job.request)
        finished = False
        try:
            if (opening := job.opening_chunk()) is not None:
                yield sse(opening)
            prompt_tokens, completion_tokens = job.request.prompt_tokens, 0
            async for out in outputs:
                timer.output(out)
                finished = out.finished
                prompt_tokens = out.prompt_tokens or prompt_tokens
                completion_tokens = out.completion_tokens
                if out.finish_reason == "error":
                    yield sse(_error(out.error or "the engine failed", 500))
                    break
                chunk = job.chunk(out.text, _finish(out) if out.finished else None)
                if job.include_usage:
                    tokens = usage(prompt_tokens, completion_tokens)
                    chunk["usage"] = tokens if job.continuous_usage else None
                yield sse(chunk)
            else:
                if job.include_usage:
                    yield sse(job.usage_chunk(usage(prompt_tokens, completion_tokens)))
        except EngineError as exc:
            finished = True
            yield sse(_error(str(exc), 500))
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await engine.abort(job.request.request_id)
            if isinstance(outputs, AsyncGenerator):
                with anyio.CancelScope(shield=True):
                    await outputs.aclose()
        yield SSE_DONE

    app.state.metrics_registry = metrics.registry
    return app


def _finish(out: EngineOutput) -> FinishReason:
    return out.finish_reason or "stop"


async def _body(request: Request, chat: bool) -> _CompletionBody | _ChatBody:
    try:
        payload = await request.json()
    except ValueError as exc:
        raise _BadRequest(f"The body is not valid JSON: {exc}") from exc
    model = _ChatBody if chat else _CompletionBody
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        details = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
            for error in exc.errors()
        )
        raise _BadRequest(details) from exc
