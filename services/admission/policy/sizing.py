"""A request's size: what it occupies on a worker, and whether a pool's workers can run
it (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from schemas import Degradation, InferenceRequest
from services.admission.policy.cost import NO_COST, Cost
from services.common.tokenizer import count_tokens

NO_LIMITS: Mapping[str, int] = MappingProxyType({})
"""No pool's ``max_model_len`` known: nothing is refused for its length."""


def engine_cost(cost: Cost, degradation: Degradation) -> Cost:
    """What a dispatched request occupies on its worker: nothing for a static reply, its
    ``max_tokens`` at most the truncation cap."""
    if degradation.static_reply:
        return NO_COST
    cap = degradation.max_tokens_cap
    return cost if cap is None else Cost(cost.prompt_tokens, min(cost.max_tokens, cap))


def prompt_tokens(request: InferenceRequest) -> int:
    """The prompt's size for the reservation (corrected from the worker's count later):
    ingress's count where it gave one (the priority topics are written by ingress)."""
    if request.prompt_tokens is not None:
        return request.prompt_tokens
    if request.prompt is not None:
        return count_tokens(request.prompt)
    assert request.messages is not None
    return sum(count_tokens(m.content) for m in request.messages)


def sequence_tokens(request: InferenceRequest) -> int:
    """The longest sequence the request may need: its prompt plus ``max_tokens``."""
    return prompt_tokens(request) + request.sampling.max_tokens


def fits(sequence: int, pool: str, model_lens: Mapping[str, int]) -> bool:
    """Whether the pool's workers can run a sequence of ``sequence`` tokens (yes when
    their limit is unknown)."""
    limit = model_lens.get(pool)
    return limit is None or sequence <= limit
