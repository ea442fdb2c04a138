"""The routes about the service rather than inference: ``/health``,
``/openapi.json``, ``/metrics`` and ``GET /v1/models``."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.ingress import metrics as m
from services.ingress import openai as oai
from services.ingress.admit import bearer, source_of
from services.ingress.errors import refused
from services.ingress.front import front_of
from services.ingress.refusals import Refusal


async def health(request: Request) -> Response:
    ok = front_of(request).ready()
    return JSONResponse({"status": "ok" if ok else "unavailable"}, 200 if ok else 503)


async def openapi(request: Request) -> Response:
    return JSONResponse(front_of(request).openapi)


async def models(request: Request) -> Response:
    front = front_of(request)
    settings = front.settings
    principal = await front.pipeline.authenticate(
        bearer(request.headers.get("authorization")),
        action="read",
        source=source_of(request, settings.proxies),
    )
    if isinstance(principal, Refusal):
        return refused("models", principal, {})
    m.HTTP_RESPONSES.labels("models", "200").inc()
    return JSONResponse(
        oai.models_list(list(settings.models)), headers=principal.deprecation_headers
    )
