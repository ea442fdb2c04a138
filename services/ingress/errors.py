"""The HTTP front's error responses: OpenAI's error body (``openai.ApiError``) with its
status and headers, counted by endpoint and status."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from services.ingress import metrics as m
from services.ingress import openai as oai
from services.ingress.refusals import Refusal
from services.ingress.settings import IngressSettings

_ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/models": "models",
}


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


def unavailable(settings: IngressSettings, code: str, message: str) -> oai.ApiError:
    return oai.ApiError(503, code, message, None, oai.retry_after(settings.retry_after_s))


def endpoint_of(request: Request) -> str:
    """A metric label: the known endpoints by name, every other path as one."""
    return _ENDPOINTS.get(request.url.path, "other")
