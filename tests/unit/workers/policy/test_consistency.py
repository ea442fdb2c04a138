"""Output consistency: fingerprints, the simulated engine's repeatable text, shadow runs."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import (
    DispatchedRequest,
    InferenceReply,
    InferenceRequest,
    ReasonCode,
    ReplyStatus,
    SamplingParams,
    ShadowOrder,
)
from services.workers.engine.sim_config import SimConfig, SimFaults
from services.workers.policy.consistency import Comparison, fingerprint, similarity
from services.workers.policy.dispatches import engine_request_for
from services.workers.shadows import SHADOW_MAX_AGE_S, run_shadow, shadow_for, shadow_partition
from tests.unit.workers.engine.test_sim_engine import collect, request, started

pytestmark = pytest.mark.unit

WORDS = st.sampled_from(
    [
        "the",
        "a",
        "to",
        "of",
        "and",
        "in",
        "is",
        "it",
        "you",
        "that",
        "order",
        "ship",
        "item",
        "price",
    ]
)
TEXTS = st.lists(WORDS, max_size=60).map(" ".join)


@given(TEXTS, TEXTS)
def test_similarity_is_symmetric_within_0_and_1_and_1_for_equal_texts(a: str, b: str) -> None:
    fa, fb = fingerprint(a), fingerprint(b)
    assert 0.0 <= similarity(fa, fb) == similarity(fb, fa) <= 1.0
    assert similarity(fa, fingerprint(a)) == 1.0
    assert (fa.digest == fb.digest) == (a == b)


def test_a_changed_ending_is_alike_and_a_different_text_is_not() -> None:
    words = [f"w{i}" for i in range(200)]
    text = " ".join(words)
    ending = " ".join(words[:180] + ["x"] * 20)
    other = " ".join(f"v{i}" for i in range(200))
    assert 0.7 < similarity(fingerprint(text), fingerprint(ending)) < 1.0
    assert similarity(fingerprint(text), fingerprint(other)) < 0.1


def test_a_fingerprint_is_small_whatever_the_text() -> None:
    long = fingerprint(" ".join(f"w{i}" for i in range(20_000)))
    assert len(long.model_dump_json()) < 1_000


def dispatch(
    temperature: float = 0.0, seed: int | None = None, **changes: object
) -> DispatchedRequest:
    req = InferenceRequest(
        request_id="r1",
        tenant="t",
        prompt="where is my order",
        sampling=SamplingParams(max_tokens=40, temperature=temperature, seed=seed),
        reply_to="seawall.replies.x",
        created_at=time.time(),
    )
    fields: dict[str, object] = {
        "request": req,
        "pool": "main",
        "admitted_at": time.time(),
        "shadow": ShadowOrder(pool="main", min_similarity=0.5),
    }
    return DispatchedRequest(**(fields | changes))


def reply(
    text: str, finish_reason: str = "length", status: ReplyStatus = ReplyStatus.OK
) -> InferenceReply:
    return InferenceReply(
        request_id="r1",
        status=status,
        reason=ReasonCode.NONE if status is ReplyStatus.OK else ReasonCode.ENGINE_ERROR,
        text=text,
        finish_reason=finish_reason,
        worker_id="w1",
        completed_at=time.time(),
    )


def test_a_shadow_is_sent_only_for_an_ordered_whole_output() -> None:
    shadow = shadow_for(dispatch(), reply("the order ships"), "w1", 5.0)
    assert shadow is not None
    assert shadow.shadow is None
    assert shadow.admitted_at == 5.0
    assert shadow.shadow_of is not None
    assert shadow.shadow_of.worker_id == "w1"
    assert shadow.shadow_of.exact
    assert shadow.shadow_of.fingerprint == fingerprint("the order ships")
    assert shadow_for(dispatch(shadow=None), reply("x"), "w1", 5.0) is None
    assert shadow_for(dispatch(), reply("x", "abort"), "w1", 5.0) is None
    assert shadow_for(dispatch(), reply("x", status=ReplyStatus.ERROR), "w1", 5.0) is None
    seeded = shadow_for(dispatch(temperature=0.8, seed=7), reply("x"), "w1", 5.0)
    assert seeded is not None
    assert seeded.shadow_of is not None
    assert not seeded.shadow_of.exact
    assert seeded.shadow_of.min_similarity == 0.5


async def original_and_shadow(
    temperature: float = 0.0, seed: int | None = None, divergence: float = 0.0
) -> Comparison | str:
    """Run a request on one simulated engine and its shadow on another (other seed,
    other faults), as two workers of a pool would."""
    d = dispatch(temperature, seed)
    async with started(SimConfig(), seed=1) as (first, _):
        outputs = await collect(first, engine_request_for(d, "r1#1"))
    text = "".join(o.text for o in outputs)
    shadow = shadow_for(d, reply(text, outputs[-1].finish_reason or "stop"), "w1", time.time())
    assert shadow is not None
    async with started(SimConfig(faults=SimFaults(divergence=divergence)), seed=2) as (second, _):
        return await run_shadow(second, shadow, "w2", time.time())


async def test_a_greedy_request_gives_the_same_text_on_another_engine() -> None:
    outcome = await original_and_shadow()
    assert outcome == Comparison(agrees=True, similarity=1.0)


async def test_injected_divergence_is_caught() -> None:
    outcome = await original_and_shadow(divergence=1.0)
    assert isinstance(outcome, Comparison)
    assert not outcome.agrees
    assert outcome.similarity < 1.0


async def test_a_seeded_sampled_request_agrees_by_similarity() -> None:
    assert await original_and_shadow(temperature=0.8, seed=11) == Comparison(True, 1.0)


async def test_sampling_without_a_seed_departs_from_the_greedy_words() -> None:
    async with started(SimConfig()) as (engine, _):
        greedy = await collect(engine, request("g", 40, temperature=0.0))
        hot = await collect(engine, request("h", 40, temperature=2.0))
    texts = ["".join(o.text for o in run) for run in (greedy, hot)]
    assert texts[0] != texts[1]


async def test_a_shadow_skips_its_own_worker_and_a_stale_one() -> None:
    shadow = shadow_for(dispatch(), reply("x"), "w1", time.time())
    assert shadow is not None
    async with started(SimConfig()) as (engine, _):
        assert await run_shadow(engine, shadow, "w1", time.time()) == "same_worker"
        late = time.time() + SHADOW_MAX_AGE_S + 1
        assert await run_shadow(engine, shadow, "w2", late) == "stale"


def test_a_shadow_goes_to_a_partition_its_worker_does_not_own() -> None:
    secret = bytes(32)
    picks = {
        shadow_partition(dispatch().model_copy(update={"request": r}), range(6), {0, 2}, secret)
        for r in (dispatch().request.model_copy(update={"request_id": f"r{i}"}) for i in range(200))
    }
    assert picks == {1, 3, 4, 5}
    assert shadow_partition(dispatch(), range(3), {0, 1, 2}, secret) is None
