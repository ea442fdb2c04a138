"""The scheduler figures of a ``vllm serve`` ``/metrics`` page (Prometheus text).

:class:`.openai_http.OpenAIHttpEngine` scrapes the page in the background and reads it
with :func:`parse_vllm_metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class ScrapedMetrics:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    preempted_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


# Sample names of a `vllm serve` /metrics page; each is summed over its label sets
# (model, engine). vLLM before 0.10 named the KV gauge vllm:gpu_cache_usage_perc.
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_PREEMPTIONS = "vllm:num_preemptions_total"
_PROMPT_TOKENS = "vllm:prompt_tokens_total"
_GENERATION_TOKENS = "vllm:generation_tokens_total"


def parse_vllm_metrics(text: str) -> ScrapedMetrics:
    """Read the scheduler figures from Prometheus text; absent metrics read as zero.

    Counts add up across engines (data-parallel ranks); KV usage takes the fullest one,
    since that engine is the first to preempt.
    """
    sums: dict[str, float] = {}
    kv_usage: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _KV_USAGE:
                kv_usage[sample.name] = max(kv_usage.get(sample.name, 0.0), sample.value)
            else:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    usage = next((kv_usage[name] for name in _KV_USAGE if name in kv_usage), 0.0)
    return ScrapedMetrics(
        running=int(sums.get(_RUNNING, 0)),
        waiting=int(sums.get(_WAITING, 0)),
        kv_cache_usage=usage,
        preempted_total=int(sums.get(_PREEMPTIONS, 0)),
        prompt_tokens_total=int(sums.get(_PROMPT_TOKENS, 0)),
        generation_tokens_total=int(sums.get(_GENERATION_TOKENS, 0)),
    )
