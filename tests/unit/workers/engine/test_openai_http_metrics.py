"""The HTTP adapter's /metrics parsing: vLLM's Prometheus text. The adapter against a live
server is tested in tests/integration/workers/."""

import pytest

from services.workers.engine.openai_http_metrics import ScrapedMetrics, parse_vllm_metrics

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
