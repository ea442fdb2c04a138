"""The HTTP API as an OpenAPI 3.1 document, served at ``/openapi.json``.

The request bodies' schemas are generated from the models ingress parses them with
(``openai.ChatBody`` and ``openai.CompletionBody``), so the document cannot drift from
what is accepted; the responses are OpenAI's shapes as ``openai`` writes them, and every
error is OpenAI's error body with the statuses ``openai`` maps refusals and replies to.
``tests/e2e/test_openapi.py`` runs schemathesis against the running stack with it.
"""

from __future__ import annotations

from typing import Any

from services.ingress import openai as oai

_ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_USAGE: dict[str, Any] = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        k: {"type": "integer", "minimum": 0}
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}


def _answer(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "minItems": 1, "items": choice},
            "usage": _USAGE,
        },
    }


_CHAT_CHOICE = {
    "type": "object",
    "required": ["index", "message", "finish_reason"],
    "properties": {
        "index": {"type": "integer"},
        "message": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
        },
        "finish_reason": {"enum": ["stop", "length"]},
    },
}
_TEXT_CHOICE = {
    "type": "object",
    "required": ["index", "text", "finish_reason"],
    "properties": {
        "index": {"type": "integer"},
        "text": {"type": "string"},
        "finish_reason": {"enum": ["stop", "length"]},
    },
}

_ERRORS = {
    "400": "Invalid request: the body, a parameter, or a prompt longer than the model runs",
    "401": "No valid API key",
    "403": "The key may not do this, or a filter refused the content",
    "413": "The body is larger than ingress accepts",
    "429": "Over the tenant's quota or a region's throttle (X-RateLimit-*, Retry-After)",
    "500": "An internal error",
    "502": "The worker failed the request",
    "503": "Overloaded, a breaker open, or a store unavailable (Retry-After)",
    "504": "Not answered before the request's deadline",
}


def _errors(*statuses: str) -> dict[str, Any]:
    return {
        s: {
            "description": _ERRORS[s],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for s in statuses
    }


def _inference(summary: str, body: str, answer: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "parameters": [
                {
                    "name": "X-Seawall-Timeout",
                    "in": "header",
                    "required": False,
                    "description": "The request's deadline, in seconds (capped by the server)",
                    "schema": {"type": "number", "exclusiveMinimum": 0},
                },
                {
                    "name": "X-Session-Id",
                    "in": "header",
                    "required": False,
                    "description": "The session (worker affinity, canary side)",
                    "schema": {"type": "string", "maxLength": 128},
                },
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}
                },
            },
            "responses": {
                "200": {
                    "description": "The answer; with stream=true, server-sent events ending "
                    "with data: [DONE]",
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{answer}"}},
                        # each event: data is a chunk's JSON, or [DONE] at the end
                        "text/event-stream": {
                            "schema": {
                                "type": "object",
                                "required": ["data"],
                                "properties": {"data": {"type": "string"}},
                            }
                        },
                    },
                },
                **_errors("400", "401", "403", "413", "429", "500", "502", "503", "504"),
            },
        }
    }


def openapi_document(version: str) -> dict[str, Any]:
    """The document for ingress of seawall ``version``."""
    chat = oai.ChatBody.model_json_schema(ref_template="#/components/schemas/{model}")
    completion = oai.CompletionBody.model_json_schema(ref_template="#/components/schemas/{model}")
    shared = {**chat.pop("$defs", {}), **completion.pop("$defs", {})}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "seawall ingress",
            "version": version,
            "description": "OpenAI-compatible chat and text completions in front of a "
            "vLLM fleet, with quotas, priorities and breakers.",
        },
        "paths": {
            "/v1/chat/completions": _inference("A chat completion", "ChatBody", "ChatCompletion"),
            "/v1/completions": _inference("A text completion", "CompletionBody", "Completion"),
            "/v1/models": {
                "get": {
                    "summary": "The models this API serves",
                    "security": [{"bearer": []}],
                    "responses": {
                        "200": {
                            "description": "The model list",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/ModelList"}
                                }
                            },
                        },
                        **_errors("401", "403", "429", "503"),
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Ready to serve (200) or not (503)",
                    "responses": {
                        s: {
                            "description": d,
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "required": ["status"],
                                        "properties": {"status": {"enum": ["ok", "unavailable"]}},
                                    }
                                }
                            },
                        }
                        for s, d in (("200", "Ready"), ("503", "Not ready"))
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                **shared,
                "ChatBody": chat,
                "CompletionBody": completion,
                "ChatCompletion": _answer("chat.completion", _CHAT_CHOICE),
                "Completion": _answer("text_completion", _TEXT_CHOICE),
                "ModelList": {
                    "type": "object",
                    "required": ["object", "data"],
                    "properties": {
                        "object": {"const": "list"},
                        "data": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["id", "object"],
                                "properties": {
                                    "id": {"type": "string"},
                                    "object": {"const": "model"},
                                },
                            },
                        },
                    },
                },
                "Error": _ERROR,
            },
        },
    }
