"""Request shapes that both OpenAI-compatible servers here share — ingress's API and
``seawall sim-serve`` (the stand-in for ``vllm serve``): one choice per request, one
prompt per completion, and message content as a string or a list of text parts."""

from __future__ import annotations

from typing import Literal

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
