"""What a dispatched request asks of the engine, and how its answer is qualified (pure):
shared by the worker's runs, its shadow runs and the incident benchmark."""

from __future__ import annotations

from typing import Final

from schemas import DispatchedRequest, ReasonCode
from schemas.requests import Priority
from services.common.tokenizer import count_tokens
from services.workers.engine.base import EngineRequest

#: vLLM's ``priority``: lower runs first.
ENGINE_PRIORITY: Final = {Priority.VIP: 0, Priority.STANDARD: 1, Priority.BULK: 2}
REPLY_TEXT_LIMIT: Final = 65_536
"""A reply carries at most this many characters of text (``schemas.LongText``)."""


def prompt_text(d: DispatchedRequest) -> str:
    """The prompt the engine sees: chat messages flattened as ``role: content`` lines."""
    req = d.request
    if req.prompt is not None:
        return req.prompt
    assert req.messages is not None
    return "\n".join(f"{msg.role}: {msg.content}" for msg in req.messages) + "\nassistant:"


def degraded_reason(d: DispatchedRequest) -> ReasonCode:
    g = d.degradation
    if g.static_reply:
        return ReasonCode.DEGRADED_STATIC
    if g.max_tokens_cap is not None and g.max_tokens_cap < d.request.sampling.max_tokens:
        return ReasonCode.DEGRADED_TRUNCATED
    if g.diverted_from is not None:
        return ReasonCode.DEGRADED_SMALL_MODEL
    if g.scavenged:
        return ReasonCode.SCAVENGED
    if g.quota_degraded:
        return ReasonCode.QUOTA_DEGRADED
    return ReasonCode.NONE


def max_output_tokens(d: DispatchedRequest) -> int:
    """What the client asked for, within degradation level 2's cap."""
    cap = d.degradation.max_tokens_cap
    wanted = d.request.sampling.max_tokens
    return wanted if cap is None else min(wanted, cap)


def engine_request_for(d: DispatchedRequest, engine_request_id: str) -> EngineRequest:
    """The engine's request for ``d``, under its own id (a generation's, a shadow's)."""
    req = d.request
    prompt = prompt_text(d)
    return EngineRequest(
        request_id=engine_request_id,
        prompt=prompt,
        prompt_tokens=count_tokens(prompt),
        max_tokens=max_output_tokens(d),
        temperature=req.sampling.temperature,
        top_p=req.sampling.top_p,
        stop=req.sampling.stop,
        priority=ENGINE_PRIORITY[req.priority],
        seed=req.sampling.seed,
    )
