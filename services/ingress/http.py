"""The OpenAI-compatible HTTP front: ``POST /v1/chat/completions``, ``POST
/v1/completions`` (JSON or server-sent events), ``GET /v1/models``, ``/health``,
``/metrics``.

A request goes through the gate (``pipeline.py``) onto its priority topic, and the
handler waits on this instance's reply topic (``ReplyRouter``) for its answer: until
the request's deadline plus a margin, then 504. It never talks to a GPU. A stream's
status is decided by the first thing that comes back: a terminal error before any
chunk is a plain HTTP error; once chunks have gone out, a later error is sent as an
``error`` event, then ``[DONE]``.

A client that goes away (or that the handler stops waiting for) leaves an abort marker
in Redis (``RedisKeys.abort``), which admission checks before dispatching: the request
is then answered ``cancelled`` instead of costing GPU time.

Every response carries ``X-Request-Id``; a key in its grace period adds
``Deprecation`` and ``Sunset``. Status mapping: see ``openai.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from importlib.metadata import version

import anyio
from aiokafka.errors import KafkaError
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from schemas import ClientMeta, InferenceReply, InferenceRequest, ReplyChunk
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.streams import ReplyItem, ReplyRouterClosed, ReplyStream
from services.ingress import metrics as m
from services.ingress import openai as oai
from services.ingress.filters.body import check_declared_length
from services.ingress.filters.geo import client_address
from services.ingress.openapi import openapi_document
from services.ingress.pipeline import Gate, Principal, Refusal, body_too_large, invalid
from services.ingress.replies import ReplyRouter

log = logging.getLogger(__name__)

_ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/models": "models",
}
TIMEOUT_HEADER = "x-seawall-timeout"
SESSION_HEADER = "x-session-id"


def source_of(conn: HTTPConnection, trusted_proxies: int) -> str:
    """The client's address (past ``trusted_proxies``); empty when unknown."""
    peer = conn.client.host if conn.client else None
    address = client_address(conn.headers.getlist("x-forwarded-for"), peer, trusted_proxies)
    return str(address.ip) if address.ip is not None else ""


@dataclass(frozen=True, slots=True)
class Admitted:
    request: InferenceRequest
    principal: Principal
    shape: oai.Shape


async def admit_body(
    gate: Gate,
    parsed: oai.Body,
    principal: Principal,
    *,
    request_id: str,
    reply_to: str,
    timeout_s: float | None,
    session_id: str | None,
    client: ClientMeta,
    clock: Clock,
) -> Admitted | Refusal:
    """A parsed body of an authenticated client, as it goes onto its priority topic
    (``Gate.prepare``), with the shape of its answers; or why it may not. HTTP and
    WebSocket requests take this one path."""
    model = parsed.model or next(iter(gate.settings.models))
    now = clock.time()
    draft = oai.to_request(
        parsed,
        request_id=request_id,
        tenant=principal.tenant,
        model=model,
        reply_to=reply_to,
        created_at=now,
        timeout_s=timeout_s,
        session_id=session_id,
        client=client,
    )
    if isinstance(draft, Refusal):
        return draft
    prepared = await gate.prepare(draft, principal)
    if isinstance(prepared, Refusal):
        return prepared
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    shape = oai.Shape(isinstance(parsed, oai.ChatBody), request_id, model, int(now), include_usage)
    return Admitted(prepared, principal, shape)


class _SseResponse(StreamingResponse):
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


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, credentials = authorization.partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else None


def _timeout_header(value: str | None) -> float | Refusal | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        return invalid("invalid_timeout", "X-Seawall-Timeout must be positive seconds.", "timeout")
    return seconds


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(
    gate: Gate,
    router: ReplyRouter,
    ready: Callable[[], bool],
    clock: Clock = SYSTEM_CLOCK,
    websocket: Callable[[WebSocket], Awaitable[None]] | None = None,
) -> FastAPI:
    """The app; ``gate`` and ``router`` are started and stopped by their owner (the
    ingress service), ``ready`` says whether they are up (``/health``); ``websocket``
    serves ``/v1/ws`` (``services.ingress.websocket``)."""
    settings = gate.settings
    app = FastAPI(title="seawall ingress", docs_url=None, redoc_url=None, openapi_url=None)
    if websocket is not None:
        app.add_api_websocket_route("/v1/ws", websocket)

    def error_response(
        endpoint: str, error: oai.ApiError, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        m.HTTP_RESPONSES.labels(endpoint, str(error.status)).inc()
        return JSONResponse(
            error.body(), status_code=error.status, headers={**(headers or {}), **error.headers}
        )

    def refused(endpoint: str, refusal: Refusal, headers: dict[str, str]) -> JSONResponse:
        m.REQUESTS.labels("http", "refused").inc()
        m.REFUSALS.labels("http", refusal.code).inc()
        return error_response(endpoint, oai.error_for_refusal(refusal), headers)

    def unavailable(code: str, message: str) -> oai.ApiError:
        return oai.ApiError(503, code, message, None, oai.retry_after(settings.retry_after_s))

    def endpoint_of(request: Request) -> str:
        """A metric label: the known endpoints by name, every other path as one."""
        return _ENDPOINTS.get(request.url.path, "other")

    @app.exception_handler(RedisError)
    async def _redis_down(request: Request, exc: RedisError) -> Response:
        log.error("redis failed", extra={"error": type(exc).__name__})
        m.REQUESTS.labels("http", "unavailable").inc()
        error = unavailable("key_store_unavailable", "The key store is unavailable.")
        return error_response(endpoint_of(request), error)

    @app.exception_handler(KafkaError)
    async def _kafka_down(request: Request, exc: KafkaError) -> Response:
        log.error("kafka failed", extra={"error": type(exc).__name__})
        m.REQUESTS.labels("http", "unavailable").inc()
        error = unavailable("bus_unavailable", "The request bus is unavailable.")
        return error_response(endpoint_of(request), error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
        error = oai.ApiError(exc.status_code, code, str(exc.detail))
        return error_response(endpoint_of(request), error)

    @app.get("/health")
    async def health() -> Response:
        ok = ready()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, 200 if ok else 503)

    document = openapi_document(version("seawall"))

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return JSONResponse(document)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        principal = await gate.authenticate(
            bearer(request.headers.get("authorization")),
            action="read",
            source=source_of(request, settings.trusted_proxies),
        )
        if isinstance(principal, Refusal):
            return refused("models", principal, {})
        m.HTTP_RESPONSES.labels("models", "200").inc()
        return JSONResponse(
            oai.models_list(list(settings.models)), headers=principal.deprecation_headers
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await infer(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await infer(request, chat=False)

    # -- admission to the bus ------------------------------------------------------
    async def read_body(request: Request) -> bytes | Refusal:
        limit = settings.max_body_bytes
        declared = check_declared_length(request.headers.get("content-length"), limit)
        if declared.reason == "bad_content_length":
            return invalid("bad_content_length", "The Content-Length header is malformed.")
        if declared.reason is not None:
            return body_too_large(limit)
        body = bytearray()
        async for part in request.stream():
            body += part
            too_large = Gate.check_size(body, limit)
            if too_large is not None:
                return too_large
        return bytes(body)

    async def admit(request: Request, chat: bool, request_id: str) -> Admitted | Refusal:
        body = await read_body(request)
        if isinstance(body, Refusal):
            return body
        user_agent = request.headers.get("user-agent")
        refusal = gate.check_user_agent(user_agent)
        if refusal is not None:
            return refusal
        source = source_of(request, settings.trusted_proxies)
        principal = await gate.authenticate(
            bearer(request.headers.get("authorization")), source=source
        )
        if isinstance(principal, Refusal):
            return principal
        parsed: oai.Body | Refusal = (
            oai.parse_body(body, oai.ChatBody) if chat else oai.parse_body(body, oai.CompletionBody)
        )
        if isinstance(parsed, Refusal):
            return parsed
        timeout = _timeout_header(request.headers.get(TIMEOUT_HEADER))
        if isinstance(timeout, Refusal):
            return timeout
        return await admit_body(
            gate,
            parsed,
            principal,
            request_id=request_id,
            reply_to=router.topic,
            timeout_s=timeout,
            session_id=request.headers.get(SESSION_HEADER) or parsed.user,
            client=ClientMeta(user_agent=(user_agent or "")[:512], client_ip=source),
            clock=clock,
        )

    async def infer(request: Request, *, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        request_id = uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        admitted = await admit(request, chat, request_id)
        if isinstance(admitted, Refusal):
            return refused(endpoint, admitted, headers)
        headers |= admitted.principal.deprecation_headers
        req = admitted.request
        stream = router.register(request_id)  # before publishing: the reply may be quick
        try:
            await (await gate.publish(req))
        except BaseException:
            router.unregister(request_id)
            raise
        m.REQUESTS.labels("http", "published").inc()
        waiter = Waiter(gate, router, stream, req, clock)
        handed_over = False
        try:
            if not req.stream:
                return await json_reply(endpoint, request, waiter, admitted.shape, headers)
            response = await stream_reply(endpoint, request, waiter, admitted.shape, headers)
            handed_over = isinstance(response, _SseResponse)  # it closes the waiter
            return response
        finally:
            if not handed_over:
                with anyio.CancelScope(shield=True):
                    await waiter.close()

    # -- answers ---------------------------------------------------------------------
    async def first_reply(
        endpoint: str,
        request: Request,
        waiter: Waiter,
        reply: Awaitable[ReplyItem],
        headers: dict[str, str],
    ) -> ReplyItem | Response:
        """``reply``'s item, or the response that ends the request without one: the
        client left, the deadline passed, ingress is stopping, or an error reply."""
        gone = asyncio.create_task(_disconnected(request))
        try:
            item = await waiter.first_of(reply, gone)
        except ReplyRouterClosed:
            return error_response(endpoint, unavailable("shutting_down", "Ingress is stopping."))
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
        return _SseResponse(events(waiter, shape, first), headers, waiter.close)

    async def events(waiter: Waiter, shape: oai.Shape, first: ReplyItem) -> AsyncIterator[str]:
        opening = shape.opening_chunk()
        if opening is not None:
            yield oai.sse(opening)
        sent: list[str] = []
        item: ReplyItem | TimeoutError = first
        while True:
            if isinstance(item, TimeoutError):
                yield oai.sse(deadline_error().body())
                break
            if isinstance(item, ReplyChunk):
                sent.append(item.text)
                yield oai.sse(shape.chunk(item.text))
            else:
                error = oai.error_for_reply(item, settings.retry_after_s)
                if error is not None:
                    yield oai.sse(error.body())
                    break
                streamed = "".join(sent)
                # Chunks that never came (a reply without streaming, such as a static
                # degraded one): the rest of the terminal reply's text.
                if item.text.startswith(streamed) and len(item.text) > len(streamed):
                    yield oai.sse(shape.chunk(item.text[len(streamed) :]))
                yield oai.sse(shape.final_chunk(item))
                if shape.include_usage:
                    yield oai.sse(shape.usage_chunk(item))
                break
            try:
                item = await waiter.next()
            except ReplyRouterClosed:
                yield oai.sse(unavailable("shutting_down", "Ingress is stopping.").body())
                break
        yield oai.SSE_DONE

    return app


def deadline_error() -> oai.ApiError:
    return oai.ApiError(504, "deadline_exceeded", "No answer came before the request's deadline.")


class Waiter:
    """One published request's wait for its replies, bounded by its deadline (plus
    the margin); sets the abort marker if it ends before the terminal reply."""

    def __init__(
        self,
        gate: Gate,
        router: ReplyRouter,
        stream: ReplyStream,
        request: InferenceRequest,
        clock: Clock,
    ) -> None:
        self._gate = gate
        self._router = router
        self.stream = stream
        self._request = request
        assert request.deadline_at is not None, "the gate gives every request a deadline"
        remaining = request.deadline_at - clock.time() + gate.settings.reply_margin_s
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
        if isinstance(item, InferenceReply):
            m.REPLY_WAIT.observe(time.monotonic() - self._published)
        return item

    async def close(self) -> None:
        """Stop waiting (idempotent); abort the request if its answer is unfinished."""
        if self._closed:
            return
        self._closed = True
        m.WAITING.dec()
        self._router.unregister(self._request.request_id)
        if self.stream.terminal is None:
            if self._timed_out:
                cause = "timeout"
            else:
                cause = "disconnect" if self._router.running else "shutdown"
            with contextlib.suppress(RedisError):
                await self._gate.abort(
                    self._request.tenant, self._request.request_id, self._request.deadline_at, cause
                )
