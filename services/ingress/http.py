"""The OpenAI-compatible HTTP front, assembled: ``POST /v1/chat/completions``, ``POST
/v1/completions`` (JSON or server-sent events; ``completions.py``, answered by
``answers.py``), ``GET /v1/models``, ``/health``, ``/openapi.json``, ``/metrics``
(``meta.py``), ``/v1/ws`` (``websocket.py``), and the exception handlers that turn a
failed Redis or Kafka, or an unknown path or method, into OpenAI's error body.

The routes are module-level functions; what they share (the pipeline, the reply router,
readiness, the clock) is the ``Front`` on ``app.state`` (``front.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from importlib.metadata import version

from aiokafka.errors import KafkaError
from fastapi import FastAPI, Request
from fastapi.responses import Response
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.websockets import WebSocket

from seawall_client.clock import SYSTEM_CLOCK, Clock
from services.ingress import completions, meta
from services.ingress import metrics as m
from services.ingress import openai as oai
from services.ingress.errors import endpoint_of, error_response, unavailable
from services.ingress.front import Front, front_of
from services.ingress.openapi import openapi_document
from services.ingress.pipeline import IngressPipeline
from services.ingress.replies import ReplyRouter

log = logging.getLogger(__name__)


def create_app(
    pipeline: IngressPipeline,
    router: ReplyRouter,
    ready: Callable[[], bool],
    clock: Clock = SYSTEM_CLOCK,
    websocket: Callable[[WebSocket], Awaitable[None]] | None = None,
) -> FastAPI:
    """The app; ``pipeline`` and ``router`` are started and stopped by their owner (the
    ingress service), ``ready`` says whether they are up (``/health``); ``websocket``
    serves ``/v1/ws`` (``services.ingress.websocket``)."""
    app = FastAPI(title="seawall ingress", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = Front(pipeline, router, ready, clock, openapi_document(version("seawall")))
    if websocket is not None:
        app.add_api_websocket_route("/v1/ws", websocket)
    app.add_exception_handler(
        RedisError, _outage("redis", "key_store_unavailable", "The key store is unavailable.")
    )
    app.add_exception_handler(
        KafkaError, _outage("kafka", "bus_unavailable", "The request bus is unavailable.")
    )
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.get("/health")(meta.health)
    app.get("/openapi.json")(meta.openapi)
    app.get("/metrics")(meta.metrics)
    app.get("/v1/models")(meta.models)
    app.post("/v1/chat/completions")(completions.chat_completions)
    app.post("/v1/completions")(completions.completions)
    return app


def _outage(
    dependency: str, code: str, message: str
) -> Callable[[Request, Exception], Awaitable[Response]]:
    """The answer while a dependency is down: 503 with ``Retry-After``, logged and
    counted; the client retries and nothing was half done."""

    async def handler(request: Request, exc: Exception) -> Response:
        log.error(f"{dependency} failed", extra={"error": type(exc).__name__})
        m.REQUESTS.labels("http", "unavailable").inc()
        error = unavailable(front_of(request).settings, code, message)
        return error_response(endpoint_of(request), error)

    return handler


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    code = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
    error = oai.ApiError(exc.status_code, code, str(exc.detail))
    return error_response(endpoint_of(request), error)
