"""What both OpenAI-compatible servers here share — ingress's API and ``seawall
sim-serve`` (the stand-in for ``vllm serve``): the request shapes (one choice per
request, one prompt per completion, message content as a string or a list of text
parts) and the frame of every answer (id, envelope, usage, server-sent events). The
choices inside differ: ingress answers as OpenAI does, sim-serve as vLLM does."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


def content_text(content: str | list[TextPart] | None) -> str:
    """A message's text, its parts joined."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


class OneChoice(BaseModel):
    """``n`` other than 1 is refused: neither server returns several choices."""

    n: int = 1

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n


class OnePrompt(BaseModel):
    """A completion's ``prompt``: a string, or a list of exactly one string."""

    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError("exactly one prompt is supported")
        return prompt

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


# --- answers ---------------------------------------------------------------------------


def completion_id(chat: bool, request_id: str) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"


def chunk_object(chat: bool) -> str:
    """The ``object`` of a streamed chunk."""
    return "chat.completion.chunk" if chat else "text_completion"


def envelope(
    answer_id: str, obj: str, created: int, model: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    """An answer or chunk around its ``choices``."""
    return {"id": answer_id, "object": obj, "created": created, "model": model, "choices": choices}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: the payload as compact JSON (or the text as it is)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")
