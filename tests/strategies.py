"""Hypothesis strategies that draw JSON documents valid under our exported JSON Schemas.

Covers the subset pydantic emits for ``schemas/``: objects with properties, required
and additionalProperties, strings with length and pattern, bounded numbers, booleans,
null, enum/const, anyOf, arrays/tuples, and local ``$ref``s. Unsupported keywords raise,
so a schema change that outgrows this fails loudly rather than testing less.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

_SUPPORTED = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "title",
    "description",
    "default",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "enum",
    "const",
    "anyOf",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "maxProperties",
    "minProperties",
    "$ref",
    "$defs",
    "$schema",
    "$id",
    "discriminator",
    "propertyNames",
    "oneOf",
    "patternProperties",
    # annotations of seawall's own (the signing recipe of records on the ingress topic)
    "x-seawall-record-headers",
    "x-seawall-signing",
}
_TEXT = st.characters(codec="utf-8", exclude_categories=("Cs",))


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    return _strategy(schema, schema.get("$defs", {}))


def _strategy(node: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    unknown = set(node) - _SUPPORTED
    if unknown:
        raise NotImplementedError(f"JSON Schema keywords not supported here: {sorted(unknown)}")
    if "$ref" in node:
        return st.deferred(lambda: _strategy(defs[node["$ref"].split("/")[-1]], defs))
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    for key in ("anyOf", "oneOf"):
        if key in node:
            return st.one_of([_strategy(branch, defs) for branch in node[key]])
    kind = node.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        return _number(node, integer=kind == "integer")
    if kind == "string":
        return _string(node)
    if kind == "array":
        return _array(node, defs)
    if kind == "object":
        return _object(node, defs)
    raise NotImplementedError(f"JSON Schema node not supported here: {node}")


def _number(node: dict[str, Any], integer: bool) -> st.SearchStrategy[Any]:
    lo = node.get("minimum", node.get("exclusiveMinimum"))
    hi = node.get("maximum", node.get("exclusiveMaximum"))
    if integer:
        lo = None if lo is None else int(lo) + ("exclusiveMinimum" in node)
        hi = None if hi is None else int(hi) - ("exclusiveMaximum" in node)
        return st.integers(min_value=lo, max_value=hi)
    return st.floats(
        min_value=lo,
        max_value=hi,
        allow_nan=False,
        allow_infinity=False,
        exclude_min="exclusiveMinimum" in node,
        exclude_max="exclusiveMaximum" in node,
    )


def _string(node: dict[str, Any]) -> st.SearchStrategy[str]:
    lo, hi = node.get("minLength", 0), min(node.get("maxLength", 200), 200)
    if node.get("format") == "base64url":
        return st.binary(max_size=hi * 3 // 4).map(_b64url)
    if "pattern" in node:
        return st.from_regex(node["pattern"], fullmatch=True).filter(lambda s: lo <= len(s) <= hi)
    return st.text(_TEXT, min_size=lo, max_size=hi)


def _b64url(raw: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(raw).decode()


def _array(node: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[list[Any]]:
    lo, hi = node.get("minItems", 0), min(node.get("maxItems", 4), 4)
    if "prefixItems" in node:
        return st.tuples(*(_strategy(n, defs) for n in node["prefixItems"])).map(list)
    return st.lists(
        _strategy(node.get("items", {"type": "string"}), defs), min_size=lo, max_size=max(lo, hi)
    )


def _object(node: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    props: dict[str, Any] = node.get("properties", {})
    if props:
        required = set(node.get("required", []))
        fixed = {k: _strategy(v, defs) for k, v in props.items() if k in required}
        optional = {k: _strategy(v, defs) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(fixed, optional=optional)
    names = dict(node.get("propertyNames", {"maxLength": 20}))
    values = node.get("additionalProperties", {"type": "string"})
    if "patternProperties" in node:
        ((pattern, values),) = node["patternProperties"].items()
        names["pattern"] = pattern
    keys = _string(names)
    lo, hi = node.get("minProperties", 0), min(node.get("maxProperties", 4), 4)
    return st.dictionaries(keys, _strategy(values, defs), min_size=lo, max_size=max(lo, hi))
