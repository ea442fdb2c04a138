"""The HTTP app in process (ASGI), on the paths answered before any key lookup (no
broker, no Redis), and with a key store that cannot be reached. The paths past
authentication are tested on the real broker and Redis (tests/integration/ingress)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from services.ingress.http import create_app
from tests.unit.ingress.conftest import Parts

pytestmark = pytest.mark.unit

CHAT = b'{"messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture
def ready() -> dict[str, bool]:
    return {"value": True}


@pytest.fixture
async def client(parts: Parts, ready: dict[str, bool]) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(parts.pipeline, parts.router, lambda: ready["value"], parts.clock)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as c:
        yield c


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code


async def test_oversize_bodies_are_refused_before_parsing(client: httpx.AsyncClient) -> None:
    big = b"{" * (16 * 1024 + 1)
    declared = await client.post("/v1/chat/completions", content=big)
    assert_error(declared, 413, "body_too_large")
    assert declared.headers["X-Request-Id"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while read
        for _ in range(17):
            yield b" " * 1024

    streamed = await client.post("/v1/completions", content=chunks())
    assert_error(streamed, 413, "body_too_large")


async def test_blacklisted_clients_are_refused(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions", content=CHAT, headers={"User-Agent": "sqlmap/1.7"}
    )
    assert_error(response, 403, "user_agent_blocked")
    assert response.json()["error"]["type"] == "permission_error"


@pytest.mark.parametrize(
    ("authorization", "code"),
    [
        (None, "missing_api_key"),
        ("Bearer ", "missing_api_key"),
        ("Basic dXNlcjpwYXNz", "missing_api_key"),
        ("Bearer not-a-key", "invalid_api_key"),
        ("Bearer sk-sw-XYZ_abc", "invalid_api_key"),
    ],
)
async def test_requests_without_a_well_formed_key_are_401(
    client: httpx.AsyncClient, authorization: str | None, code: str
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    response = await client.post("/v1/chat/completions", content=CHAT, headers=headers)
    assert_error(response, 401, code)
    models = await client.get("/v1/models", headers=headers)
    assert_error(models, 401, code)


async def test_health_metrics_and_unknown_routes(
    client: httpx.AsyncClient, ready: dict[str, bool]
) -> None:
    assert (await client.get("/health")).json() == {"status": "ok"}
    ready["value"] = False
    assert (await client.get("/health")).status_code == 503
    # /metrics is the metrics port's (SEAWALL_METRICS_PORT), never the public API's.
    assert_error(await client.get("/metrics"), 404, "not_found")
    assert_error(await client.get("/v1/nothing"), 404, "not_found")
    assert_error(await client.get("/v1/completions"), 405, "method_not_allowed")


async def test_an_unreachable_key_store_is_503(client: httpx.AsyncClient) -> None:
    """The parts' Redis is a port nothing listens on: the key lookup fails."""
    key = "sk-sw-0123456789ab_" + "A" * 43
    response = await client.post(
        "/v1/chat/completions", content=CHAT, headers={"Authorization": f"Bearer {key}"}
    )
    assert_error(response, 503, "key_store_unavailable")
    assert response.headers["Retry-After"] == "1"
