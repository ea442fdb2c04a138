"""The OpenAI-compatible HTTP front, assembled: ``POST /v1/chat/completions``, ``POST
/v1/completions`` (JSON or server-sent events; ``completions.py``, answered by
``answers.py``), ``GET /v1/models``, ``/health``, ``/openapi.json`` (``meta.py``),
``/v1/ws`` (``websocket.py``), and the exception handlers that turn a failed Redis or
Kafka, or an unknown path or method, into OpenAI's error body. Not ``/metrics``: it is
served on the metrics port (``SEAWALL_METRICS_PORT``), as every service's is, never on
the public API (its label values are the fleet's, not a client's to read).

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
from starlette.types import Receive, Scope, Send
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

REDIS_DOWN = ("redis", "key_store_unavailable", "The key store is unavailable.")
KAFKA_DOWN = ("kafka", "bus_unavailable", "The request bus is unavailable.")


def create_app(
    pipeline: IngressPipeline,
    router: ReplyRouter,
    ready: Callable[[], bool],
    clock: Clock = SYSTEM_CLOCK,
    websocket: Callable[[WebSocket], Awaitable[None]] | None = None,
) -> InferenceFront:
    """The app; ``pipeline`` and ``router`` are started and stopped by their owner (the
    ingress service), ``ready`` says whether they are up (``/health``); ``websocket``
    serves ``/v1/ws`` (``services.ingress.websocket``)."""
    app = FastAPI(title="seawall ingress", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = Front(pipeline, router, ready, clock, openapi_document(version("seawall")))
    if websocket is not None:
        app.add_api_websocket_route("/v1/ws", websocket)
    app.add_exception_handler(RedisError, _outage(*REDIS_DOWN))
    app.add_exception_handler(KafkaError, _outage(*KAFKA_DOWN))
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.get("/health")(meta.health)
    app.get("/openapi.json")(meta.openapi)
    app.get("/v1/models")(meta.models)
    app.post("/v1/chat/completions")(completions.chat_completions)
    app.post("/v1/completions")(completions.completions)
    return InferenceFront(app)


class InferenceFront:
    """The app, with ``POST /v1/chat/completions`` and ``POST /v1/completions`` handed
    straight to their handlers.

    FastAPI puts every request through its middleware stack, router and dependency
    machinery before the handler runs: for a request ingress refuses (a bad key, a
    tenant over quota, a body too large) that was most of its cost (py-spy: 55 % of
    ingress's CPU under a stream of refusals, the handler 23 %). The two inference
    routes take no FastAPI feature (no dependencies, no validation of their own: the
    handler reads and checks the body itself), so they skip it; the same two outage
    answers apply (503 with ``Retry-After`` when Redis or Kafka fails), and anything
    else unexpected is a logged 500 in OpenAI's error shape. Every other path and
    method goes to FastAPI as before."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._routes = {
            "/v1/chat/completions": completions.chat_completions,
            "/v1/completions": completions.completions,
        }
        self._redis_down = _outage(*REDIS_DOWN)
        self._kafka_down = _outage(*KAFKA_DOWN)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        scope["app"] = self.app
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except RedisError as e:
            response = await self._redis_down(request, e)
        except KafkaError as e:
            response = await self._kafka_down(request, e)
        except Exception:
            log.exception("request failed", extra={"path": scope["path"]})
            error = oai.ApiError(500, "internal_error", "The server failed to handle this.")
            response = error_response(endpoint_of(request), error)
        await response(scope, receive, send)


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
