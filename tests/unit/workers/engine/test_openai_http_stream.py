"""The HTTP adapter's stream parsing: completion chunks into engine outputs. The adapter
against a live server is tested in tests/integration/workers/."""

from typing import Any

import pytest

from services.workers.engine.base import EngineError, EngineOutput, EngineRequest
from services.workers.engine.openai_http_stream import CompletionStream

pytestmark = pytest.mark.unit


REQUEST = EngineRequest(request_id="r1", prompt="Hello", prompt_tokens=2, max_tokens=5)


def _chunk(
    text: str | None, finish: str | None = None, usage: dict[str, int] | None = None
) -> dict[str, Any]:
    choices = (
        []
        if text is None
        else [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        ]
    )
    return {
        "id": "cmpl-r1",
        "object": "text_completion",
        "created": 1,
        "model": "llama",
        "choices": choices,
        "usage": usage,
    }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _feed(chunks: list[dict[str, Any]]) -> list[EngineOutput]:
    stream = CompletionStream(REQUEST)
    outputs = [out for chunk in chunks if (out := stream.feed(chunk)) is not None]
    return [*outputs, stream.close()]


def test_continuous_usage_gives_exact_token_counts() -> None:
    outputs = _feed(
        [
            _chunk(" Par", usage=_usage(3, 1)),
            _chunk("is", usage=_usage(3, 3)),  # two tokens in one chunk
            _chunk(".", finish="stop", usage=_usage(3, 4)),
            _chunk(None, usage=_usage(3, 4)),
        ]
    )
    assert [(o.text, o.new_tokens, o.completion_tokens) for o in outputs] == [
        (" Par", 1, 1),
        ("is", 2, 3),
        (".", 1, 4),
    ]
    final = outputs[-1]
    assert (final.finished, final.finish_reason, final.prompt_tokens) == (True, "stop", 3)
    assert not any(o.finished for o in outputs[:-1])


def test_without_usage_each_text_chunk_counts_one_token() -> None:
    outputs = _feed([_chunk("a"), _chunk(""), _chunk("b"), _chunk("c", finish="length")])
    assert [(o.text, o.new_tokens) for o in outputs] == [("a", 1), ("", 0), ("b", 1), ("c", 1)]
    assert outputs[-1].completion_tokens == 3
    assert outputs[-1].prompt_tokens == REQUEST.prompt_tokens
    assert outputs[-1].finish_reason == "length"


def test_final_usage_corrects_the_simple_count() -> None:
    outputs = _feed([_chunk("ab"), _chunk("cd", finish="length"), _chunk(None, usage=_usage(4, 5))])
    final = outputs[-1]
    assert (final.text, final.new_tokens, final.completion_tokens) == ("cd", 4, 5)
    assert final.prompt_tokens == 4
    assert sum(o.new_tokens for o in outputs) == final.completion_tokens


def test_an_error_chunk_ends_the_request_with_finish_reason_error() -> None:
    stream = CompletionStream(REQUEST)
    assert stream.feed(_chunk("a")) is not None
    error = {"error": {"message": "KV load failed", "type": "InternalServerError"}}
    assert stream.feed(error) is None
    assert stream.feed(_chunk("b")) is None  # nothing after the error counts
    final = stream.close()
    assert (final.finished, final.finish_reason) == (True, "error")
    assert final.error is not None
    assert "KV load failed" in final.error


def test_a_stream_without_finish_reason_is_an_engine_error() -> None:
    stream = CompletionStream(REQUEST)
    stream.feed(_chunk("a"))
    with pytest.raises(EngineError, match="without a finish reason"):
        stream.close()
