"""The HTTP adapter's wire parsing: vLLM's /metrics text and completion chunks. The
adapter against a live server is tested in tests/integration/workers/."""

from typing import Any

import pytest

from services.workers.engine.base import EngineError, EngineOutput, EngineRequest
from services.workers.engine.openai_http import (
    CompletionStream,
    ScrapedMetrics,
    parse_vllm_metrics,
)

pytestmark = pytest.mark.unit

# The shape of a two-engine (data-parallel) `vllm serve` page.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 12.0
vllm:num_requests_running{engine="1",model_name="llama"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 4.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.83
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.41
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="llama"} 7.0
vllm:num_preemptions_total{engine="1",model_name="llama"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="llama"} 5000.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="llama"} 900.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="llama"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama"} 0.9
"""


def test_parse_sums_counts_and_takes_the_fullest_kv_cache() -> None:
    assert parse_vllm_metrics(VLLM_METRICS) == ScrapedMetrics(
        running=21,
        waiting=4,
        kv_cache_usage=0.83,
        preempted_total=8,
        prompt_tokens_total=5000,
        generation_tokens_total=900,
    )


def test_parse_reads_the_old_kv_gauge_name() -> None:
    text = "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.5\n"
    assert parse_vllm_metrics(text).kv_cache_usage == 0.5


def test_parse_of_an_empty_page_is_idle() -> None:
    assert parse_vllm_metrics("") == ScrapedMetrics()


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
