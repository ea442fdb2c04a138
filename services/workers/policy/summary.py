"""What a worker tells the controller about the requests it finished: one
``RequestSummary`` per report interval instead of a record per request (pure).

The controller's rows and rungs read counts, error rates and latency quantiles over
windows of seconds to minutes, and its batch limit reads EWMAs: all of it survives
summing per interval, and a sketch per interval merges into any longer window. So its
cost follows the number of workers, not their request rate.
"""

from __future__ import annotations

from schemas import RequestSummary
from schemas.telemetry import LONG_PROMPT_TOKENS
from services.common.sketch import SketchBuilder


def inter_token_ms(
    latency_ms: float, ttft_ms: float | None, completion_tokens: int
) -> float | None:
    """A request's mean inter-token latency: its decode time over the tokens after the
    first (``None`` without a first token, or with fewer than two tokens)."""
    if ttft_ms is None or completion_tokens < 2:
        return None
    return max(0.0, latency_ms - ttft_ms) / (completion_tokens - 1)


class RequestSummarizer:
    """The requests finished since the last ``take``."""

    def __init__(self, since: float) -> None:
        self._since = since
        self._reset()

    def _reset(self) -> None:
        self._sketch = SketchBuilder()
        self._count = self._errors = 0
        self._mean = self._m2 = 0.0
        self._ttft_count = self._itl_count = 0
        self._ttft_sum = self._itl_sum = 0.0
        self._prompt_tokens = self._completion_tokens = self._long_prompts = 0
        self._checks = self._mismatches = 0
        self._similarity_sum = 0.0

    def add(
        self,
        latency_ms: float,
        ok: bool,
        ttft_ms: float | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        self._sketch.add(latency_ms)
        self._count += 1
        self._errors += 0 if ok else 1
        delta = latency_ms - self._mean  # Welford: the m2 the controller pools exactly
        self._mean += delta / self._count
        self._m2 += delta * (latency_ms - self._mean)
        if ttft_ms is not None:
            self._ttft_count += 1
            self._ttft_sum += ttft_ms
        itl = inter_token_ms(latency_ms, ttft_ms, completion_tokens)
        if itl is not None:
            self._itl_count += 1
            self._itl_sum += itl
        self._prompt_tokens += prompt_tokens
        self._long_prompts += prompt_tokens > LONG_PROMPT_TOKENS
        self._completion_tokens += completion_tokens

    def add_consistency(self, agrees: bool, similarity: float) -> None:
        """A shadow run compared with its original (``shadows``)."""
        self._checks += 1
        self._mismatches += 0 if agrees else 1
        self._similarity_sum += similarity

    def take(self, now: float) -> RequestSummary:
        """The summary of the interval ending ``now``; the next one starts."""
        summary = RequestSummary(
            window_s=min(86_400.0, max(0.0, now - self._since)),
            count=self._count,
            errors=self._errors,
            latency=self._sketch.wire(),
            latency_sum_ms=self._mean * self._count,
            latency_m2_ms2=max(0.0, self._m2),
            ttft_count=self._ttft_count,
            ttft_sum_ms=self._ttft_sum,
            itl_count=self._itl_count,
            itl_sum_ms=self._itl_sum,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._completion_tokens,
            long_prompts=self._long_prompts,
            consistency_checks=self._checks,
            consistency_mismatches=self._mismatches,
            consistency_similarity_sum=self._similarity_sum,
        )
        self._since = now
        self._reset()
        return summary
