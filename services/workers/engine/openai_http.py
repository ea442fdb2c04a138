"""``base.Engine`` over HTTP: drives a separately running ``vllm serve`` (or sim-serve).

Requests go to ``POST /v1/completions`` with ``stream=true``; the server answers with
server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``). We ask for usage on
every chunk (``stream_options.continuous_usage_stats``, a vLLM extension) so token counts
are the server's own; a server that sends none is counted one token per text chunk,
which is what vLLM streams without speculative decoding.

The chunks become outputs in :class:`.openai_http_stream.CompletionStream`. Aborting a
request cancels the task reading its stream: the connection closes and vLLM aborts the
request server-side. Scheduler figures come from the server's ``/metrics``, scraped in
the background every ``scrape_interval_s`` (:mod:`.openai_http_metrics`). The server
does not publish its engine limits, so they come from configuration.

Priorities: vLLM orders by ``priority`` only when started with ``--scheduling-policy
priority``; a stock ``vllm serve`` (FCFS) refuses any non-zero priority with a 400. The
engine does not ask beforehand (nothing on the server says): it sends priorities until
the server refuses one for that reason, then sends the same request again without it
and never sends one again (logged once; ``priority_scheduling`` in the snapshot's
extras: 1 accepted, 0 refused, -1 not yet known). Either way every request is served;
on an FCFS server the order is admission's alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx

from services.workers.engine.base import (
    EngineError,
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineSnapshot,
    RequestRefused,
    snapshot_of,
)
from services.workers.engine.openai_http_metrics import ScrapedMetrics, parse_vllm_metrics
from services.workers.engine.openai_http_stream import CompletionStream, error_body_text

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


_END: Final = object()


class _PrioritiesRefused(Exception):
    """The server refused a request for its priority alone: send it again without."""


PRIORITY_REFUSED = "Priority scheduling is not enabled"
"""What vLLM answers (400) to a priority when it schedules first come, first served."""
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
        self.priorities: bool | None = None
        """Whether the server accepts priorities (``None``: not known yet)."""

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
        known = {None: -1.0, True: 1.0, False: 0.0}[self.priorities]
        return snapshot_of(
            metrics,
            self.limits,
            {"metrics_stale": 1.0 if self._metrics_stale else 0.0, "priority_scheduling": known},
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
        if request.priority != 0 and self.priorities is not False:
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
            await self._stream(client, request, queue)
        except _PrioritiesRefused:
            await self._stream(client, request, queue)  # the same, without its priority

    async def _stream(
        self, client: httpx.AsyncClient, request: EngineRequest, queue: asyncio.Queue[object]
    ) -> None:
        try:
            body = self._body(request)
            async with client.stream(
                "POST",
                "/v1/completions",
                json=body,
                headers={"X-Request-Id": request.request_id},
            ) as response:
                if response.status_code >= 400:
                    detail = error_body_text(await response.aread())
                    if "priority" in body and PRIORITY_REFUSED in detail:
                        self._refused_priorities(detail)
                        raise _PrioritiesRefused
                    text = f"request {request.request_id}: HTTP {response.status_code}: {detail}"
                    if response.status_code in _REFUSALS:
                        raise RequestRefused(text)
                    raise EngineError(text)
                if "priority" in body:
                    self.priorities = True
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

    def _refused_priorities(self, detail: str) -> None:
        if self.priorities is not False:
            logger.warning(
                "%s schedules first come, first served (%s): requests go without their "
                "priority from now on; start it with --scheduling-policy priority to have "
                "the engine order them too",
                self._config.base_url,
                detail[:200],
            )
        self.priorities = False

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
