"""Time to first token, predicted before a request costs anything (pure).

A request's first token comes after the prefill of every prompt ahead of it and of its
own. Ahead of it: the prompt tokens queued in its pool's engines (``prefill_in_pool``,
the pacing rule's estimate) and those waiting in admission in its own class or a higher
one (they are dispatched first). The pool prefills at the sum of its workers' learned
rates (``workers.WorkerState.prefill_rate``: the peak throughput of report intervals that
had a queue throughout, slowly forgotten), so::

    ttft ≈ (queued in the engines + waiting at or above its class + its prompt) / rate

where "queued in the engines" is all of it for the lowest class only: the engines run
vLLM's priority policy, so a higher class waits for about the step running now (it
under-predicts rather than refuse what would have been served).

No rate learned yet (a pool that never queued) → no prediction: nothing is refused on a
guess. The estimate leaves out the decode steps interleaved with the prefill and the
bus hops, so it errs early, which is the safe side for what admission does with it:
refuse at once, with a ``Retry-After`` of the predicted wait, a request whose first
token cannot come before its deadline (Mooncake's early rejection), instead of letting
it wait, take its quota and GPU time, and expire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas import Priority
from services.admission.policy.scheduler import ORDER


@dataclass(frozen=True, slots=True)
class PoolForecast:
    prefill_rate: float
    """Prompt tokens per second the pool's live workers prefill (0: not learned)."""
    queued_tokens: int = 0
    """Prompt tokens queued in its engines, waiting for their first token."""
    waiting_tokens: Mapping[Priority, int] = field(default_factory=dict)
    """Prompt tokens waiting in admission for the pool, per class."""
    step_tokens: int = 0
    """One engine step's prompt tokens on every live worker (Σ ``max_num_batched_tokens``):
    what a request that outranks the engines' waiting queue still waits for."""

    def ahead_of(self, cls: Priority) -> int:
        """Tokens waiting in admission that go before a request of ``cls``."""
        rank = ORDER.index(cls)
        return sum(self.waiting_tokens.get(c, 0) for c in ORDER[: rank + 1])


def predict(prompt_tokens: int, cls: Priority, forecast: PoolForecast) -> float | None:
    """Seconds until the first token of a request of ``cls`` arriving now; ``None``
    while the pool's prefill rate is unknown."""
    if forecast.prefill_rate <= 0:
        return None
    queued = forecast.queued_tokens
    if cls is not ORDER[-1]:
        # The engines order their waiting queue by class (vLLM's priority policy): all
        # but the lowest class may outrank most of it; count only the running step.
        queued = min(queued, forecast.step_tokens)
    return (queued + forecast.ahead_of(cls) + prompt_tokens) / forecast.prefill_rate
