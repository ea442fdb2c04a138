"""The HTTP API against its own OpenAPI document (``/openapi.json``), with schemathesis
generating requests — valid and invalid bodies, headers, sizes — against ``seawall up``:
every answer has a status, content type and body the document declares, the only 5xx
is a 504 for a request whose own deadline (``X-Seawall-Timeout``, or the body's
``timeout``) ran out, and every request is answered."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.stack import Stack, launch

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    with launch(
        tmp_path_factory.mktemp("stack"),
        redis_url,
        "--workers",
        "1",
        "--small-workers",
        "0",
        # a generated request asks for up to the engine's whole context: keep the
        # simulated engines quick; a request setting X-Seawall-Timeout may ask for less
        env={"SEAWALL_SIM_TIME_SCALE": "0.02", "SEAWALL_DEFAULT_DEADLINE_S": "10"},
    ) as s:
        yield s


@pytest.fixture(scope="module")
def api_key(stack: Stack) -> str:
    return stack.key("openapi-co", "enterprise")["key"]


def test_every_answer_is_one_the_document_declares(stack: Stack, api_key: str) -> None:
    api = schemathesis.openapi.from_url(f"{stack.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} == {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
    }
    seen: dict[str, list[int]] = {}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=30,
            deadline=None,
            database=None,
            derandomize=True,  # the same examples in every run: CI fails on code, not luck
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        def check(case: Case) -> None:
            response = case.call(base_url=stack.url, headers={"Authorization": f"Bearer {api_key}"})
            if response.status_code >= 500:
                # The only server-side answer allowed: the deadline the request itself
                # set ran out (504) — by X-Seawall-Timeout or the body's OpenAI
                # ``timeout`` — never a failure of ours.
                asked = {k.lower(): v for k, v in (case.headers or {}).items()}
                body = case.body if isinstance(case.body, dict) else {}
                assert response.status_code == 504, response.text
                assert "x-seawall-timeout" in asked or "timeout" in body, (asked, response.text)
            seen.setdefault(case.operation.path, []).append(response.status_code)
            case.validate_response(
                response,
                checks=[
                    status_code_conformance,
                    content_type_conformance,
                    response_schema_conformance,
                ],
                excluded_checks=[not_a_server_error],  # a 504 is, when the client asked
            )

        check()
    # generated bodies were sent, and both served and refused
    chat = seen["/v1/chat/completions"]
    assert len(chat) >= 20
    assert 200 in chat
    assert any(400 <= s < 500 for s in chat)
