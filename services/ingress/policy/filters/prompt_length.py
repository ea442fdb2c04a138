"""Prompt length: the token count and the buckets of its Prometheus histogram.

Tokens are counted with the fleet's simple tokenizer (``count_tokens``, about four
characters per token for Latin text and one per CJK character), the same one the
workers use when no model tokenizer is loaded, so that quotas, histograms and the
engine agree. DESIGN alerts when more than 30% of prompts exceed 4k tokens, so 4096 is
a bucket boundary and the share can be read straight off the histogram.

Note the 16 KiB body limit: an ASCII prompt that passes it is at most about 4k tokens,
so long prompts arrive mostly as CJK text or over Kafka.
"""

from __future__ import annotations

from schemas.telemetry import LONG_PROMPT_TOKENS
from services.common.tokenizer import count_tokens

__all__ = [
    "LONG_PROMPT_ALERT_SHARE",
    "LONG_PROMPT_TOKENS",
    "PROMPT_TOKEN_BUCKETS",
    "count_tokens",
    "is_long",
    "long_prompt_share_promql",
]

LONG_PROMPT_ALERT_SHARE = 0.30

PROMPT_TOKEN_BUCKETS: tuple[float, ...] = tuple(float(2**k) for k in range(4, 16))
"""Upper bounds (``le``) for the prompt-token histogram, 16 … 32768 (4096 among them);
``+Inf`` is implied."""


def is_long(tokens: int) -> bool:
    return tokens > LONG_PROMPT_TOKENS


def long_prompt_share_promql(metric: str, window: str = "5m") -> str:
    """PromQL for the share of prompts over ``LONG_PROMPT_TOKENS`` in ``window``;
    alert when it exceeds ``LONG_PROMPT_ALERT_SHARE``."""
    le = repr(float(LONG_PROMPT_TOKENS))  # prometheus_client renders bounds as floats
    return (
        f'1 - sum(rate({metric}_bucket{{le="{le}"}}[{window}]))'
        f" / sum(rate({metric}_count[{window}]))"
    )
