"""``base.Engine`` over HTTP: drives a separately running ``vllm serve`` (or sim-serve).

Requests go to ``POST /v1/completions`` with ``stream=true``; the server answers with
server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``). We ask for usage on
every chunk (``stream_options.continuous_usage_stats``, a vLLM extension) so token counts
are the server's own; a server that sends none is counted one token per text chunk,
which is what vLLM streams without speculative decoding.

Aborting a request cancels the task reading its stream: the connection closes and vLLM
aborts the request server-side. Scheduler figures come from the server's ``/metrics``,
scraped in the background every ``scrape_interval_s``. The server does not publish its
engine limits, so they come from configuration.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.workers.engine.base import (
    EngineError,
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineSnapshot,
    RequestRefused,
)
from services.workers.engine.vllm_engine import map_finish_reason

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OpenAIHttpConfig:
    base_url: str
    """The server's root, e.g. ``http://gpu-7:8000`` (the ``/v1`` paths are appended)."""
    model: str
    limits: EngineLimits
    """What the server was started with (``--max-num-seqs`` and so on)."""
    scrape_interval_s: float = 1.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float | None = 300.0
    """Longest silence between two chunks; a queued request may wait this long."""
    api_key: str | None = None


@dataclass(frozen=True, slots=True)
class ScrapedMetrics:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    preempted_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


# Sample names of a `vllm serve` /metrics page; each is summed over its label sets
# (model, engine). vLLM before 0.10 named the KV gauge vllm:gpu_cache_usage_perc.
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_PREEMPTIONS = "vllm:num_preemptions_total"
_PROMPT_TOKENS = "vllm:prompt_tokens_total"
_GENERATION_TOKENS = "vllm:generation_tokens_total"


def parse_vllm_metrics(text: str) -> ScrapedMetrics:
    """Read the scheduler figures from Prometheus text; absent metrics read as zero.

    Counts add up across engines (data-parallel ranks); KV usage takes the fullest one,
    since that engine is the first to preempt.
    """
    sums: dict[str, float] = {}
    kv_usage: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _KV_USAGE:
                kv_usage[sample.name] = max(kv_usage.get(sample.name, 0.0), sample.value)
            else:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    usage = next((kv_usage[name] for name in _KV_USAGE if name in kv_usage), 0.0)
    return ScrapedMetrics(
        running=int(sums.get(_RUNNING, 0)),
        waiting=int(sums.get(_WAITING, 0)),
        kv_cache_usage=usage,
        preempted_total=int(sums.get(_PREEMPTIONS, 0)),
        prompt_tokens_total=int(sums.get(_PROMPT_TOKENS, 0)),
        generation_tokens_total=int(sums.get(_GENERATION_TOKENS, 0)),
    )


def _error_text(payload: object) -> str:
    """The message of an OpenAI-shaped error (or of vLLM's older, flat one)."""
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
    return str(payload)[:500]


def _error_body_text(body: bytes) -> str:
    try:
        return _error_text(json.loads(body))
    except ValueError:
        return body.decode(errors="replace")[:500]


class CompletionStream:
    """Turns the completion chunks of one request into ``EngineOutput`` deltas.

    The chunk that carries the finish reason is held back until the stream ends, so that
    the final output can carry the usage the server sends after it.
    """

    def __init__(self, request: EngineRequest) -> None:
        self._request = request
        self._prompt_tokens = request.prompt_tokens
        self._completion_tokens = 0
        self._finish_reason: str | None = None
        self._tail_text = ""
        self._tail_tokens = 0
        self._error: str | None = None

    @property
    def completion_tokens(self) -> int:
        return self._completion_tokens

    def feed(self, chunk: Mapping[str, Any]) -> EngineOutput | None:
        """One parsed ``data:`` payload; returns the delta to emit, if any. An error
        payload ends the request with ``finish_reason="error"`` (the server failed this
        request; restarting the worker would not mend a separately running server)."""
        if self._error is not None:
            return None
        if "error" in chunk:
            self._error = f"server error: {_error_text(chunk)}"[:500]
            self._finish_reason = "error"
            return None
        usage = chunk.get("usage")
        counted = self._completion_tokens + self._tail_tokens
        if isinstance(usage, dict):
            self._prompt_tokens = int(usage.get("prompt_tokens", self._prompt_tokens))
        choices = chunk.get("choices") or []
        if not choices:
            if isinstance(usage, dict):  # the closing usage-only chunk
                self._tail_tokens += max(0, int(usage.get("completion_tokens", 0)) - counted)
            return None
        choice = choices[0]
        text = str(choice.get("text") or "")
        if isinstance(usage, dict):
            new_tokens = max(0, int(usage.get("completion_tokens", 0)) - counted)
        else:
            new_tokens = 1 if text else 0
        if (finish_reason := choice.get("finish_reason")) is not None:
            self._finish_reason = str(finish_reason)
        if self._finish_reason is not None:
            self._tail_text += text
            self._tail_tokens += new_tokens
            return None
        self._completion_tokens += new_tokens
        return EngineOutput(
            request_id=self._request.request_id,
            text=text,
            new_tokens=new_tokens,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._completion_tokens,
        )

    def close(self) -> EngineOutput:
        """The final delta once the stream has ended (``[DONE]`` or end of body)."""
        if self._finish_reason is None:
            raise EngineError(
                f"request {self._request.request_id}: the stream ended without a finish reason"
            )
        self._completion_tokens += self._tail_tokens
        return EngineOutput(
            request_id=self._request.request_id,
            text=self._tail_text,
            new_tokens=self._tail_tokens,
            finished=True,
            finish_reason=map_finish_reason(self._finish_reason),
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._completion_tokens,
            error=self._error,
        )


_END: Final = object()
_REFUSALS = frozenset({400, 404, 413, 422})
"""HTTP statuses that refuse the request itself (vLLM answers 400 for a prompt longer
than its context); any other error is the server's."""


class OpenAIHttpEngine:
    """``base.Engine`` for an OpenAI-compatible vLLM server."""

    name = "openai-http"

    def __init__(self, config: OpenAIHttpConfig) -> None:
        self._config = config
        self._client: httpx.AsyncClient | None = None
        self._scraper: asyncio.Task[None] | None = None
        self._metrics = ScrapedMetrics()
        self._metrics_stale = True
        self._streams: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        """Connect and read ``/metrics`` once; ``EngineError`` if the server does not answer."""
        if self._client is not None:
            return
        api_key = self._config.api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.AsyncClient(
            base_url=self._config.base_url,
            headers=headers,
            timeout=httpx.Timeout(
                connect=self._config.connect_timeout_s,
                read=self._config.read_timeout_s,
                write=self._config.connect_timeout_s,
                pool=None,
            ),
        )
        self._client = client
        try:
            await self._scrape()
        except EngineError:
            self._client = None
            await client.aclose()
            raise
        self._scraper = asyncio.create_task(self._scrape_loop(), name="openai-http-scrape")

    async def stop(self) -> None:
        scraper, self._scraper = self._scraper, None
        tasks = [*self._streams.values(), *([scraper] if scraper else [])]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        client = self._started()
        if request.request_id in self._streams:
            raise EngineError(f"request {request.request_id} is already streaming")
        queue: asyncio.Queue[object] = asyncio.Queue()
        pump = asyncio.create_task(
            self._pump(client, request, queue), name=f"openai-http-{request.request_id}"
        )
        # The callback also runs for a pump cancelled before it started, which never
        # reaches its own code.
        pump.add_done_callback(lambda _: queue.put_nowait(_END))
        self._streams[request.request_id] = pump
        decoder = CompletionStream(request)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    if pump.cancelled():
                        yield self._aborted(request, decoder.completion_tokens)
                    else:
                        yield decoder.close()
                    return
                if isinstance(item, EngineError | RequestRefused):
                    raise item
                assert isinstance(item, dict)  # all else the pump sends is above
                if (output := decoder.feed(item)) is not None:
                    yield output
        finally:
            self._streams.pop(request.request_id, None)
            if not pump.done():
                pump.cancel()
                await asyncio.wait([pump])

    async def abort(self, request_id: str) -> None:
        """Close the request's stream; ``generate`` then ends with an ``abort`` output."""
        if (pump := self._streams.get(request_id)) is not None:
            pump.cancel()

    async def profile(self, seconds: float, path: Path) -> str:
        """The server's profiler (vLLM's ``/start_profile`` and ``/stop_profile``, served
        when it runs with ``VLLM_TORCH_PROFILER_DIR``): the trace is on the server."""
        client = self._client
        if client is None:
            raise EngineError("the engine is not started")
        (await client.post("/start_profile")).raise_for_status()
        try:
            await asyncio.sleep(seconds)
        finally:
            (await client.post("/stop_profile")).raise_for_status()
        return f"{self._config.base_url}: the server's VLLM_TORCH_PROFILER_DIR"

    def snapshot(self) -> EngineSnapshot:
        metrics = self._metrics
        return EngineSnapshot(
            running=metrics.running,
            waiting=metrics.waiting,
            preempted_total=metrics.preempted_total,
            kv_cache_usage=metrics.kv_cache_usage,
            limits=self.limits,
            prompt_tokens_total=metrics.prompt_tokens_total,
            generation_tokens_total=metrics.generation_tokens_total,
            extra={"metrics_stale": 1.0 if self._metrics_stale else 0.0},
        )

    @property
    def limits(self) -> EngineLimits:
        return self._config.limits

    def _started(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineError("the OpenAI-HTTP engine is not started")
        return self._client

    def _body(self, request: EngineRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._config.model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if request.stop:
            body["stop"] = list(request.stop)
        if request.seed is not None:
            body["seed"] = request.seed
        if request.priority != 0:
            # vLLM rejects a non-zero priority unless started with --scheduling-policy
            # priority; 0 is its default, so leaving it out works everywhere.
            body["priority"] = request.priority
        return body

    async def _pump(
        self, client: httpx.AsyncClient, request: EngineRequest, queue: asyncio.Queue[object]
    ) -> None:
        """Read one SSE stream into ``queue``: chunk dicts, perhaps an ``EngineError``.

        ``generate`` learns that the stream is over from the task's done callback, and
        whether it was aborted from the task's state.
        """
        try:
            async with client.stream(
                "POST",
                "/v1/completions",
                json=self._body(request),
                headers={"X-Request-Id": request.request_id},
            ) as response:
                if response.status_code >= 400:
                    body = await response.aread()
                    text = (
                        f"request {request.request_id}: HTTP {response.status_code}: "
                        f"{_error_body_text(body)}"
                    )
                    if response.status_code in _REFUSALS:
                        raise RequestRefused(text)
                    raise EngineError(text)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event names
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        raise EngineError(f"request {request.request_id}: odd chunk {data[:200]}")
                    queue.put_nowait(chunk)
        except (EngineError, RequestRefused) as exc:
            queue.put_nowait(exc)
        except (httpx.HTTPError, ValueError) as exc:
            queue.put_nowait(EngineError(f"request {request.request_id}: {exc!r}"))

    @staticmethod
    def _aborted(request: EngineRequest, completion_tokens: int) -> EngineOutput:
        return EngineOutput(
            request_id=request.request_id,
            text="",
            new_tokens=0,
            finished=True,
            finish_reason="abort",
            prompt_tokens=request.prompt_tokens,
            completion_tokens=completion_tokens,
        )

    async def _scrape(self) -> None:
        client = self._started()
        try:
            response = await client.get("/metrics")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            self._metrics_stale = True
            raise EngineError(f"cannot scrape {self._config.base_url}/metrics: {exc!r}") from exc
        self._metrics = parse_vllm_metrics(response.text)
        self._metrics_stale = False

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.scrape_interval_s)
            try:
                await self._scrape()
            except EngineError as exc:
                logger.warning("%s; keeping the last figures", exc)
