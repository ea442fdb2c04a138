"""The OpenAI routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON
or server-sent events).

A request goes through the pipeline (``pipeline.py``) onto its priority topic, and the
handler waits on this instance's reply topic for its answer (``answers.py``). It never
talks to a GPU. Every response carries ``X-Request-Id``; a key in its grace period adds
``Deprecation`` and ``Sunset``. Status mapping: see ``openai.py``.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

import anyio
from fastapi import Request
from fastapi.responses import Response

from schemas import ClientMeta
from seawall_client import tracecontext
from services.common.tracing import ROOT, Span, now_ns
from services.ingress import metrics as m
from services.ingress import openai as oai
from services.ingress.admit import Admitted, admit_body, bearer, source_of
from services.ingress.answers import SseResponse, Waiter, json_reply, stream_reply
from services.ingress.errors import refused
from services.ingress.front import front_of
from services.ingress.pipeline import IngressPipeline, Principal
from services.ingress.policy.filters.body import check_declared_length
from services.ingress.refusals import Refusal, body_too_large, invalid
from services.ingress.tracing import TRACER

TIMEOUT_HEADER = "x-seawall-timeout"
SESSION_HEADER = "x-session-id"


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


async def chat_completions(request: Request) -> Response:
    return await infer(request, chat=True)


async def completions(request: Request) -> Response:
    return await infer(request, chat=False)


# -- admission to the bus ------------------------------------------------------
async def read_body(request: Request) -> bytes | Refusal:
    limit = front_of(request).settings.max_request_bytes
    declared = check_declared_length(request.headers.get("content-length"), limit)
    if declared.reason == "bad_content_length":
        return invalid("bad_content_length", "The Content-Length header is malformed.")
    if declared.reason is not None:
        return body_too_large(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        too_large = IngressPipeline.check_size(body, limit)
        if too_large is not None:
            return too_large
    return bytes(body)


@dataclass(frozen=True, slots=True)
class _Passed:
    """A request through the gate: its body, who sent it, from where, and when its
    receive and authenticate stages ran (nanoseconds, for their spans)."""

    body: bytes
    principal: Principal
    source: str
    region: str
    received: tuple[int, int]
    authenticated: tuple[int, int]


async def _gate(request: Request) -> _Passed | Refusal:
    """What ingress checks before it parses a body: its size, the User-Agent, the key,
    and admission's hint for the tenant (over quota: refused before the body is
    parsed)."""
    front = front_of(request)
    pipeline, settings = front.pipeline, front.settings
    started = now_ns()
    body = await read_body(request)
    received = now_ns()
    if isinstance(body, Refusal):
        return body
    refusal = pipeline.check_user_agent(request.headers.get("user-agent"))
    if refusal is not None:
        return refusal
    source = source_of(request, settings.proxies)
    authenticating = now_ns()
    principal = await pipeline.authenticate(
        bearer(request.headers.get("authorization")), source=source
    )
    authenticated = now_ns()
    if isinstance(principal, Refusal):
        return principal
    region, refusal = pipeline.arrive(principal, source)
    if refusal is not None:
        return refusal
    return _Passed(
        body, principal, source, region, (started, received), (authenticating, authenticated)
    )


async def admit(request: Request, chat: bool, request_id: str, root: Span) -> Admitted | Refusal:
    """The request as it goes onto its priority topic, or why it may not; ``root``: the
    request's span, under which each stage's span is recorded.

    A request refused at the gate (its body too large, its key bad, its tenant over
    admission's hint) leaves no spans: ``root`` is discarded. Its refusal is counted
    and answered with its reason, and a flood of them must not cost a span file's
    worth of writes each (0.15-0.2 ms of ingress CPU a refusal, measured); traces are
    for where an accepted request's time goes. Past the gate, the receive and
    authenticate stages are recorded with the times they took."""
    passed = await _gate(request)
    if isinstance(passed, Refusal):
        root.discard()
        return passed
    TRACER.record("ingress.receive", root.context, *passed.received)
    TRACER.record("ingress.authenticate", root.context, *passed.authenticated)
    span = TRACER.start("ingress.screen", root.context)
    try:
        return await _screen(
            request,
            chat,
            request_id,
            passed.principal,
            passed.body,
            passed.source,
            passed.region,
        )
    finally:
        span.end()


async def _screen(
    request: Request,
    chat: bool,
    request_id: str,
    principal: Principal,
    body: bytes,
    source: str,
    region: str,
) -> Admitted | Refusal:
    """The body parsed and prepared for its priority topic (``admit_body``)."""
    front = front_of(request)
    user_agent = request.headers.get("user-agent")
    parsed: oai.Body | Refusal = (
        oai.parse_body(body, oai.ChatBody) if chat else oai.parse_body(body, oai.CompletionBody)
    )
    if isinstance(parsed, Refusal):
        return parsed
    timeout = _timeout_header(request.headers.get(TIMEOUT_HEADER))
    if isinstance(timeout, Refusal):
        return timeout
    return await admit_body(
        front.pipeline,
        parsed,
        principal,
        request_id=request_id,
        reply_to=front.router.topic,
        timeout_s=timeout,
        session_id=request.headers.get(SESSION_HEADER) or parsed.user,
        client=ClientMeta(user_agent=(user_agent or "")[:512], client_ip=source),
        clock=front.clock,
        region=region,
    )


async def infer(request: Request, *, chat: bool) -> Response:
    endpoint = "chat" if chat else "completions"
    request_id = uuid.uuid4().hex
    root = TRACER.begin(
        ROOT,
        tracecontext.parse(request.headers.get(tracecontext.HEADER)),
        now_ns(),
        endpoint=endpoint,
        request_id=request_id,
    )
    handed_over = False
    try:
        response = await _infer(request, endpoint, request_id, root)
        handed_over = isinstance(response, SseResponse)  # it ends the span
        return response
    finally:
        if not handed_over:
            root.end()


async def _infer(request: Request, endpoint: str, request_id: str, root: Span) -> Response:
    front = front_of(request)
    pipeline, router = front.pipeline, front.router
    headers = {"X-Request-Id": request_id}
    admitted = await admit(request, endpoint == "chat", request_id, root)
    if isinstance(admitted, Refusal):
        root.set(refused=admitted.code)
        return refused(endpoint, admitted, headers)
    headers |= admitted.principal.deprecation_headers
    req = admitted.request
    root.set(tenant=req.tenant, priority=req.priority.value, pool=req.pool)
    stream = router.register(request_id, traced=root.recording)  # before publishing
    span = TRACER.start("ingress.publish", root.context)
    try:
        await (await pipeline.publish(req, span.context))
    except BaseException:
        router.unregister(request_id)
        raise
    span.end()
    m.REQUESTS.labels("http", "published").inc()
    waiter = Waiter(pipeline, router, stream, req, front.clock, root)
    handed_over = False
    try:
        if not req.stream:
            return await json_reply(endpoint, request, waiter, admitted.shape, headers)
        response = await stream_reply(endpoint, request, waiter, admitted.shape, headers)
        handed_over = isinstance(response, SseResponse)  # it closes the waiter
        return response
    finally:
        if not handed_over:
            with anyio.CancelScope(shield=True):
                await waiter.close()
