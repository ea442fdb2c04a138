"""The inference routes' short path past FastAPI: the same answers for what fails."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import ConnectionError as RedisConnectionError

from services.ingress.http import InferenceFront

pytestmark = pytest.mark.unit


class _Settings:
    retry_after_s = 2.0


class _Front:
    settings = _Settings()


def front(handler: object) -> InferenceFront:
    app = FastAPI()
    app.state.front = _Front()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"ok": True})

    @app.post("/v1/chat/completions")
    async def through_fastapi() -> JSONResponse:  # as the real app routes it too
        return JSONResponse({"through": "fastapi"})

    f = InferenceFront(app)
    f._routes = {"/v1/chat/completions": handler}  # type: ignore[dict-item]
    return f


async def post(app: InferenceFront, method: str = "POST") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        return await client.request(method, "/v1/chat/completions", json={})


async def test_a_handler_answers_directly() -> None:
    async def handler(request: Request) -> Response:
        assert request.app.state.front is not None  # front_of works as under FastAPI
        return JSONResponse({"handled": True})

    assert (await post(front(handler))).json() == {"handled": True}


async def test_redis_failing_is_a_503_with_retry_after() -> None:
    async def handler(request: Request) -> Response:
        raise RedisConnectionError("down")

    response = await post(front(handler))
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "key_store_unavailable"
    assert response.headers["retry-after"] == "2"


async def test_anything_else_is_a_500_in_openais_shape() -> None:
    async def handler(request: Request) -> Response:
        raise RuntimeError("bug")

    response = await post(front(handler))
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"


async def test_other_methods_and_paths_go_to_fastapi() -> None:
    async def handler(request: Request) -> Response:
        raise AssertionError("not for a GET")

    app = front(handler)
    assert (await post(app, "GET")).status_code == 405
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        assert (await client.get("/health")).json() == {"ok": True}
