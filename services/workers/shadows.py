"""Shadow runs: the worker's side of the output-consistency check.

Admission samples a share of the requests whose output should repeat — greedy ones
(temperature 0), and sampled ones that carry a seed — and orders a shadow on the
dispatch (``ShadowOrder``). The worker that answers such a request then sends its
shadow (``shadow_for``): the same request, with its answer's fingerprint
(``consistency.fingerprint``) and the worker's id, onto the order's pool — on its own
pool, to a partition it does not own. Another worker of that pool runs the shadow
(``run_shadow``) and compares the outputs; the result is counted in its report
(``RequestSummary.consistency_*``), which the controller turns into a mismatch rate per
pool, an alert, and a canary's comparison.

A shadow answers nobody: no reply, no claim, no completion record, no quota. It costs
the pool one more run, so admission samples few, and only for pools at level 0 with
their breaker closed; a shadow that waited ``SHADOW_MAX_AGE_S`` (its pool was busy) is
dropped, and so is one that came back to the original's own worker (its partition's
owner), which would only repeat itself.

Where a shadow goes (its partition, and the key that places it on a canary's topic) is
picked by a hash of the request's id keyed with the fleet's sampling secret
(``services.common.sampling``), as admission's sample is: the producer chose the id, and
unkeyed it could choose which worker runs, and judges, its shadows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

from schemas import DispatchedRequest, InferenceReply, ReplyStatus, ShadowOf
from services.common.sampling import keyed_hash
from services.workers.engine.base import Engine, RequestRefused
from services.workers.policy.consistency import Comparison, compare, fingerprint
from services.workers.policy.dispatches import REPLY_TEXT_LIMIT, engine_request_for

SHADOW_MAX_AGE_S: Final = 30.0
"""A shadow taken later than this after it was sent is dropped, not run."""

Skipped = Literal["same_worker", "stale", "refused", "incomplete"]
"""Why a shadow was not compared: it came back to the original's worker, it waited too
long, the engine refused it, or its run did not end in a full output."""


def shadow_for(
    d: DispatchedRequest, reply: InferenceReply, worker_id: str, now: float
) -> DispatchedRequest | None:
    """The shadow to send once ``d`` is answered with ``reply``: none unless admission
    ordered one and the answer is a whole output (stopped, or at its length)."""
    if d.shadow is None or reply.status is ReplyStatus.ERROR or reply.text is None:
        return None
    if reply.finish_reason not in ("stop", "length"):
        return None
    return DispatchedRequest(
        request=d.request,
        pool=d.shadow.pool,
        degradation=d.degradation,
        admitted_at=now,
        shadow_of=ShadowOf(
            worker_id=worker_id,
            fingerprint=fingerprint(reply.text),
            exact=d.request.sampling.temperature == 0,
            min_similarity=d.shadow.min_similarity,
        ),
    )


def shadow_key(d: DispatchedRequest, secret: bytes) -> bytes:
    """Not the original's key (its partition is the original worker's), nor anything its
    producer can aim: the keyed hash of the request's id (``secret``: the fleet's
    sampling secret), which places a shadow sent to another pool (a canary)."""
    return f"shadow:{keyed_hash(secret, d.request.scoped_id):016x}".encode()


def shadow_partition(
    d: DispatchedRequest, partitions: Iterable[int], owned: Iterable[int], secret: bytes
) -> int | None:
    """A partition of the shadow's pool topic that the original's worker does not own
    (picked by the request id's hash keyed with ``secret``, the fleet's sampling
    secret), so that another worker runs the shadow; ``None`` when it owns them all (the
    key then decides, and the shadow may come back)."""
    others = sorted(set(partitions) - set(owned))
    if not others:
        return None
    return others[keyed_hash(secret, d.request.scoped_id) % len(others)]


async def run_shadow(
    engine: Engine, d: DispatchedRequest, worker_id: str, now: float
) -> Comparison | Skipped:
    """Run the shadow ``d`` (``d.shadow_of`` set) and compare its output with the
    original's. ``EngineError`` propagates: the engine failing is the worker's failure,
    whatever request showed it."""
    original = d.shadow_of
    assert original is not None
    if original.worker_id == worker_id:
        return "same_worker"
    if now - d.admitted_at > SHADOW_MAX_AGE_S:
        return "stale"
    parts: list[str] = []
    try:
        async for out in engine.generate(engine_request_for(d, f"{d.request.scoped_id}#shadow")):
            parts.append(out.text)
            if out.finished and out.finish_reason not in ("stop", "length"):
                return "incomplete"
    except RequestRefused:
        return "refused"
    return compare(original, fingerprint("".join(parts)[:REPLY_TEXT_LIMIT]))
