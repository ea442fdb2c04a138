"""How a published request is answered: the wait on this instance's reply topic
(``ReplyRouter``) for its replies (``Waiter``, shared with ``websocket.py``), then, over
HTTP, one JSON response or a stream of server-sent events.

The wait lasts until the request's deadline plus a margin, then 504. A stream's status
is decided by the first thing that comes back: a terminal error before any chunk is a
plain HTTP error; once chunks have gone out, a later error is sent as an ``error``
event, then ``[DONE]``.

A client that goes away (or that the handler stops waiting for) leaves an abort marker
in Redis (``RedisKeys.abort``), which admission checks before dispatching: the request
is then answered ``cancelled`` instead of costing GPU time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.exceptions import RedisError
from starlette.types import Receive, Scope, Send

from schemas import InferenceReply, InferenceRequest, ReplyChunk
from seawall_client.clock import Clock
from seawall_client.streams import ReplyItem, ReplyRouterClosed, ReplyStream
from services.common.openai_shapes import SSE_DONE, sse
from services.common.tracing import Span, now_ns
from services.ingress import metrics as m
from services.ingress import openai as oai
from services.ingress.errors import error_response, unavailable
from services.ingress.front import front_of
from services.ingress.pipeline import IngressPipeline
from services.ingress.replies import ReplyRouter
from services.ingress.settings import IngressSettings
from services.ingress.tracing import TRACER


class SseResponse(StreamingResponse):
    """An event stream that runs ``on_close`` however it ends (finished, or cancelled
    by Starlette because the client went away), shielded from that cancellation."""

    def __init__(
        self,
        content: AsyncIterator[str],
        headers: dict[str, str],
        on_close: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def first_reply(
    endpoint: str,
    request: Request,
    waiter: Waiter,
    reply: Awaitable[ReplyItem],
    headers: dict[str, str],
) -> ReplyItem | Response:
    """``reply``'s item, or the response that ends the request without one: the
    client left, the deadline passed, ingress is stopping, or an error reply."""
    settings = front_of(request).settings
    gone = asyncio.create_task(_disconnected(request))
    try:
        item = await waiter.first_of(reply, gone)
    except ReplyRouterClosed:
        return error_response(
            endpoint, unavailable(settings, "shutting_down", "Ingress is stopping.")
        )
    finally:
        gone.cancel()
    if item is None:
        m.HTTP_RESPONSES.labels(endpoint, "499").inc()
        return Response(status_code=499)  # nobody is listening
    if isinstance(item, TimeoutError):
        return error_response(endpoint, deadline_error(), headers)
    if isinstance(item, InferenceReply):
        error = oai.error_for_reply(item, settings.retry_after_s)
        if error is not None:
            return error_response(endpoint, error, headers)
    return item


async def json_reply(
    endpoint: str, request: Request, waiter: Waiter, shape: oai.Shape, headers: dict[str, str]
) -> Response:
    reply = await first_reply(endpoint, request, waiter, waiter.stream.result(), headers)
    if isinstance(reply, Response):
        return reply
    assert isinstance(reply, InferenceReply)
    m.HTTP_RESPONSES.labels(endpoint, "200").inc()
    return JSONResponse(shape.response(reply), headers=headers | oai.success_headers(reply))


async def stream_reply(
    endpoint: str, request: Request, waiter: Waiter, shape: oai.Shape, headers: dict[str, str]
) -> Response:
    first = await first_reply(endpoint, request, waiter, waiter.stream.next(), headers)
    if isinstance(first, Response):
        return first
    if isinstance(first, InferenceReply):
        headers |= oai.success_headers(first)
    m.HTTP_RESPONSES.labels(endpoint, "200").inc()
    headers |= {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    settings = front_of(request).settings
    return SseResponse(events(settings, waiter, shape, first), headers, waiter.close)


async def events(
    settings: IngressSettings, waiter: Waiter, shape: oai.Shape, first: ReplyItem
) -> AsyncIterator[str]:
    opening = shape.opening_chunk()
    if opening is not None:
        yield sse(opening)
    sent: list[str] = []
    item: ReplyItem | TimeoutError = first
    while True:
        if isinstance(item, TimeoutError):
            yield sse(deadline_error().body())
            break
        if isinstance(item, ReplyChunk):
            sent.append(item.text)
            yield sse(shape.chunk(item.text))
        else:
            error = oai.error_for_reply(item, settings.retry_after_s)
            if error is not None:
                yield sse(error.body())
                break
            streamed = "".join(sent)
            # Chunks that never came (a reply without streaming, such as a static
            # degraded one): the rest of the terminal reply's text.
            if item.text.startswith(streamed) and len(item.text) > len(streamed):
                yield sse(shape.chunk(item.text[len(streamed) :]))
            yield sse(shape.final_chunk(item))
            if shape.include_usage:
                yield sse(shape.usage_chunk(item))
            break
        try:
            item = await waiter.next()
        except ReplyRouterClosed:
            yield sse(unavailable(settings, "shutting_down", "Ingress is stopping.").body())
            break
    yield SSE_DONE


def deadline_error() -> oai.ApiError:
    return oai.ApiError(504, "deadline_exceeded", "No answer came before the request's deadline.")


class Waiter:
    """One published request's wait for its replies, bounded by its deadline (plus
    the margin); sets the abort marker if it ends before the terminal reply."""

    def __init__(
        self,
        pipeline: IngressPipeline,
        router: ReplyRouter,
        stream: ReplyStream,
        request: InferenceRequest,
        clock: Clock,
        trace: Span | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._router = router
        self.stream = stream
        self._request = request
        self._trace = trace
        """The request's span: its first and terminal replies' stages are recorded under
        it, and it ends when the wait does."""
        self._delivered = 0
        assert request.deadline_at is not None, "the pipeline gives every request a deadline"
        remaining = request.deadline_at - clock.time() + pipeline.settings.reply_margin_s
        self._until = asyncio.get_running_loop().time() + remaining
        self._published = time.monotonic()
        self._closed = False
        self._timed_out = False
        m.WAITING.inc()

    async def first_of(
        self, reply: Awaitable[ReplyItem], gone: asyncio.Task[None]
    ) -> ReplyItem | TimeoutError | None:
        """``reply``'s result; a ``TimeoutError`` at the deadline; ``None`` if the
        client went away first."""
        task = asyncio.ensure_future(reply)
        try:
            async with asyncio.timeout_at(self._until):
                await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError as e:
            self._timed_out = True
            return e
        finally:
            if not task.done():
                task.cancel()
        if task.done():
            return self._observe(task.result())
        return None

    async def next(self) -> ReplyItem | TimeoutError:
        try:
            async with asyncio.timeout_at(self._until):
                return self._observe(await self.stream.next())
        except TimeoutError as e:
            self._timed_out = True
            return e

    def _observe(self, item: ReplyItem) -> ReplyItem:
        terminal = isinstance(item, InferenceReply)
        if terminal:
            m.REPLY_WAIT.observe(time.monotonic() - self._published)
        if self._trace is not None and self._trace.recording:
            self._trace_delivery(terminal)
        return item

    def _trace_delivery(self, terminal: bool) -> None:
        """``ingress.first_chunk`` and ``ingress.reply``: from when the worker produced
        the reply to when it is handed to the client."""
        produced = self._router.produced_ns(self._request.request_id)
        index, self._delivered = self._delivered, self._delivered + 1
        if index >= len(produced):  # not from the topic (the router closed)
            return
        parent = self._trace.context if self._trace is not None else None
        if index == 0:
            TRACER.record("ingress.first_chunk", parent, produced[0], now_ns())
        if terminal:
            TRACER.record("ingress.reply", parent, produced[index], now_ns())

    async def close(self) -> None:
        """Stop waiting (idempotent); abort the request if its answer is unfinished."""
        if self._closed:
            return
        self._closed = True
        if self._trace is not None:
            self._trace.end()
        m.WAITING.dec()
        self._router.unregister(self._request.request_id)
        if self.stream.terminal is None:
            if self._timed_out:
                cause = "timeout"
            else:
                cause = "disconnect" if self._router.running else "shutdown"
            with contextlib.suppress(RedisError):
                await self._pipeline.abort(
                    self._request.tenant, self._request.request_id, self._request.deadline_at, cause
                )
