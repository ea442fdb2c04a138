"""One streamed completion of an OpenAI-compatible server, turned into ``EngineOutput`` deltas.

The server answers ``POST /v1/completions`` with ``stream=true`` in server-sent events
(``data: {chunk}`` lines, then ``data: [DONE]``); :class:`CompletionStream` reads the
parsed chunks of one request. With usage on every chunk
(``stream_options.continuous_usage_stats``, a vLLM extension) token counts are the
server's own; a server that sends none is counted one token per text chunk, which is
what vLLM streams without speculative decoding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from services.workers.engine.base import EngineError, EngineOutput, EngineRequest
from services.workers.engine.vllm_engine import map_finish_reason


def _error_text(payload: object) -> str:
    """The message of an OpenAI-shaped error (or of vLLM's older, flat one)."""
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
    return str(payload)[:500]


def error_body_text(body: bytes) -> str:
    try:
        return _error_text(json.loads(body))
    except ValueError:
        return body.decode(errors="replace")[:500]


class CompletionStream:
    """Turns the completion chunks of one request into ``EngineOutput`` deltas.

    The chunk that carries the finish reason is held back until the stream ends, so that
    the final output can carry the usage the server sends after it.
    """

    def __init__(self, request: EngineRequest) -> None:
        self._request = request
        self._prompt_tokens = request.prompt_tokens
        self._completion_tokens = 0
        self._finish_reason: str | None = None
        self._tail_text = ""
        self._tail_tokens = 0
        self._error: str | None = None

    @property
    def completion_tokens(self) -> int:
        return self._completion_tokens

    def feed(self, chunk: Mapping[str, Any]) -> EngineOutput | None:
        """One parsed ``data:`` payload; returns the delta to emit, if any. An error
        payload ends the request with ``finish_reason="error"`` (the server failed this
        request; restarting the worker would not mend a separately running server)."""
        if self._error is not None:
            return None
        if "error" in chunk:
            self._error = f"server error: {_error_text(chunk)}"[:500]
            self._finish_reason = "error"
            return None
        usage = chunk.get("usage")
        counted = self._completion_tokens + self._tail_tokens
        if isinstance(usage, dict):
            self._prompt_tokens = int(usage.get("prompt_tokens", self._prompt_tokens))
        choices = chunk.get("choices") or []
        if not choices:
            if isinstance(usage, dict):  # the closing usage-only chunk
                self._tail_tokens += max(0, int(usage.get("completion_tokens", 0)) - counted)
            return None
        choice = choices[0]
        text = str(choice.get("text") or "")
        if isinstance(usage, dict):
            new_tokens = max(0, int(usage.get("completion_tokens", 0)) - counted)
        else:
            new_tokens = 1 if text else 0
        if (finish_reason := choice.get("finish_reason")) is not None:
            self._finish_reason = str(finish_reason)
        if self._finish_reason is not None:
            self._tail_text += text
            self._tail_tokens += new_tokens
            return None
        self._completion_tokens += new_tokens
        return EngineOutput(
            request_id=self._request.request_id,
            text=text,
            new_tokens=new_tokens,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._completion_tokens,
        )

    def close(self) -> EngineOutput:
        """The final delta once the stream has ended (``[DONE]`` or end of body)."""
        if self._finish_reason is None:
            raise EngineError(
                f"request {self._request.request_id}: the stream ended without a finish reason"
            )
        self._completion_tokens += self._tail_tokens
        return EngineOutput(
            request_id=self._request.request_id,
            text=self._tail_text,
            new_tokens=self._tail_tokens,
            finished=True,
            finish_reason=map_finish_reason(self._finish_reason),
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._completion_tokens,
            error=self._error,
        )
