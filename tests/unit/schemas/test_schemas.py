"""The wire contract: every top-level model round-trips through JSON, rejects
out-of-range values with a readable error, and matches its exported JSON Schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from aiokafka.partitioner import DefaultPartitioner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from schemas import TOP_LEVEL, InferenceRequest, SamplingParams
from schemas.base import Message, scoped_id
from schemas.export import JSON_DIR, expected_files, schema_of, stale_files
from tests.strategies import from_schema

MODELS = {m.__name__: m for m in TOP_LEVEL}

# Rules a JSON Schema cannot say, enforced by model validators (InferenceRequest: exactly
# one of prompt/messages; the deadline not before creation).
MODEL_LEVEL_RULES = (
    "exactly one of 'prompt' and 'messages'",
    "'deadline_at' is before",
    "every part of a report is its own worker's and pool's",
    "the weights must sum to 1",
    "steps must be increasing shares",
    "the last step must be 1",
    "a start command is its own release",
    "a shadow run orders no shadow of its own",
)


def test_exported_files_match_the_models() -> None:
    assert stale_files() == [], "run `python -m schemas.export` and commit schemas/json/"
    assert {p.name for p in JSON_DIR.glob("*.schema.json")} == set(expected_files())


def test_stale_files_detects_a_drifted_file(tmp_path: Any) -> None:
    for name, text in expected_files().items():
        (tmp_path / name).write_text(text)
    victim = sorted(expected_files())[0]
    (tmp_path / victim).write_text("{}\n")
    (tmp_path / "Orphan.schema.json").write_text("{}\n")
    assert stale_files(tmp_path) == sorted([victim, "Orphan.schema.json"])


def _instances(model: type[Message]) -> st.SearchStrategy[Any]:
    return from_schema(schema_of(model))


@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_round_trip_and_schema_agreement(name: str, data: st.DataObject) -> None:
    model = MODELS[name]
    schema = schema_of(model)
    doc = data.draw(_instances(model))
    try:
        obj = model.model_validate(doc)
    except ValidationError as e:
        # Anything the JSON Schema admits, the model admits, but for model-level rules.
        assert any(rule in str(e) for rule in MODEL_LEVEL_RULES), str(e)
        return
    text = obj.model_dump_json()
    again = model.model_validate_json(text)
    assert again == obj
    # What the model writes, the exported schema accepts.
    jsonschema.validate(json.loads(text), schema)


def _bounded_numeric_fields(model: type[Message]) -> list[tuple[str, str, float]]:
    """(field, 'minimum'|'maximum', bound) for each top-level bounded number."""
    out = []
    for field, prop in schema_of(model)["properties"].items():
        for branch in [prop, *prop.get("anyOf", [])]:
            if branch.get("type") in ("integer", "number"):
                for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                    if key in branch:
                        out.append((field, key, branch[key]))
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_out_of_range_numbers_are_rejected_readably(name: str, data: st.DataObject) -> None:
    model = MODELS[name]
    fields = _bounded_numeric_fields(model)
    if not fields:
        return
    doc = data.draw(_instances(model))
    try:
        model.model_validate(doc)
    except ValidationError:
        return  # a model-level rule: covered above
    field, kind, bound = data.draw(st.sampled_from(fields))
    step = data.draw(st.integers(min_value=1, max_value=10**6))
    below = kind in ("minimum", "exclusiveMinimum")
    if kind.startswith("exclusive"):
        step -= 1
    doc = {**doc, field: bound - step if below else bound + step}
    with pytest.raises(ValidationError) as info:
        model.model_validate(doc)
    assert field in str(info.value)
    assert "greater than" in str(info.value) or "less than" in str(info.value)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_absurd_sampling_is_rejected(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams.model_validate(changes)
    assert needle in str(info.value)


def _request(**changes: Any) -> dict[str, Any]:
    return {
        "request_id": "r-1",
        "tenant": "acme",
        "prompt": "hi",
        "reply_to": "replies",
        "created_at": 1.7e9,
        **changes,
    }


def test_request_needs_exactly_one_input() -> None:
    with pytest.raises(ValidationError, match="exactly one of"):
        InferenceRequest.model_validate(_request(prompt=None))
    with pytest.raises(ValidationError, match="exactly one of"):
        InferenceRequest.model_validate(_request(messages=[{"role": "user", "content": "x"}]))


@pytest.mark.parametrize(
    "changes",
    [
        {"schema_version": 2},
        {"unknown_field": 1},
        {"request_id": "has space"},
        {"reply_to": "bad/topic"},
        {"prompt": "x" * 70_000},
        {"created_at": 1.7e12},  # milliseconds by mistake
        {"created_at": float("nan")},
        {"deadline_at": 1.0},
    ],
)
def test_request_rejects_bad_fields(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        InferenceRequest.model_validate(_request(**changes))


def test_models_are_frozen() -> None:
    req = InferenceRequest.model_validate(_request())
    with pytest.raises(ValidationError):
        req.tenant = "other"  # type: ignore[misc]


def test_session_less_requests_of_one_tenant_spread_over_partitions() -> None:
    """Keyed by tenant, one tenant's load would land on one partition (one worker)."""
    partitions = list(range(8))
    chosen = {
        DefaultPartitioner()(
            InferenceRequest.model_validate(_request(request_id=f"r{i}")).dispatch_key.encode(),
            partitions,
            partitions,
        )
        for i in range(200)
    }
    assert chosen == set(partitions)
    session = InferenceRequest.model_validate(_request(request_id="r1", session_id="chat-7"))
    again = InferenceRequest.model_validate(_request(request_id="r2", session_id="chat-7"))
    assert session.dispatch_key == again.dispatch_key == "chat-7"
    assert session.partition_key == "chat-7"
    # On the ingress and priority topics a tenant's session-less records share a key.
    assert InferenceRequest.model_validate(_request()).partition_key == "acme"


IDENTS = st.from_regex(r"\A[A-Za-z0-9._:@/-]{1,128}\Z")


@given(IDENTS, IDENTS, IDENTS, IDENTS)
def test_scoped_ids_of_different_requests_differ(t1: str, r1: str, t2: str, r2: str) -> None:
    """Two tenants may choose the same id; what holds both keys them apart."""
    assert (scoped_id(t1, r1) == scoped_id(t2, r2)) == ((t1, r1) == (t2, r2))
