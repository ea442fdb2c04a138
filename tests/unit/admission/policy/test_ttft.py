"""The TTFT predictor (ttft.py) and the early refusal it drives (policy.screen)."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import InferenceRequest, Priority, ReasonCode, ReplyStatus, Tier
from seawall_client.clock import ManualClock
from services.admission.policy.bucket import DEFAULT_TIERS
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.config import PolicyConfig
from services.admission.policy.cost import Cost
from services.admission.policy.decisions import AdmissionPolicy
from services.admission.policy.dispatching import SCAVENGER, Lane, forecasts
from services.admission.policy.outcomes import Reply, Screened
from services.admission.policy.ttft import PoolForecast, predict
from services.admission.policy.workers import CapacityConfig
from services.common.control_state import ControlState
from tests.admission_helpers import Item, engine_stats

pytestmark = pytest.mark.unit

VIP, STANDARD, BULK = Priority.VIP, Priority.STANDARD, Priority.BULK
NOW = 1_800_000_000.0
WAITING = {VIP: 1_000, STANDARD: 3_000, BULK: 6_000}


def test_no_learned_rate_no_prediction() -> None:
    assert predict(100, BULK, PoolForecast(0.0, 50_000, WAITING)) is None


@pytest.mark.parametrize(
    ("cls", "engine", "ahead"),
    # the engines' priority policy: only the lowest class waits for their whole queue
    [(VIP, 1_000, 1_000), (STANDARD, 1_000, 4_000), (BULK, 5_000, 10_000)],
)
def test_a_request_waits_for_the_engines_queue_and_the_classes_before_it(
    cls: Priority, engine: int, ahead: int
) -> None:
    forecast = PoolForecast(2_000.0, queued_tokens=5_000, waiting_tokens=WAITING, step_tokens=1_000)
    assert predict(500, cls, forecast) == pytest.approx((engine + ahead + 500) / 2_000)


@given(
    rate=st.floats(1.0, 1e6),
    queued=st.integers(0, 10**6),
    waiting=st.dictionaries(st.sampled_from([VIP, STANDARD, BULK]), st.integers(0, 10**6)),
    prompt=st.integers(1, 10_000),
)
def test_higher_classes_never_wait_longer_and_more_work_never_waits_less(
    rate: float, queued: int, waiting: dict[Priority, int], prompt: int
) -> None:
    f = PoolForecast(rate, queued, waiting, step_tokens=8_192)
    vip, standard, bulk = (predict(prompt, c, f) for c in (VIP, STANDARD, BULK))
    assert vip is not None
    assert standard is not None
    assert bulk is not None
    assert vip <= standard <= bulk
    busier = predict(prompt, BULK, PoolForecast(rate, queued + 1, waiting, 8_192))
    assert busier is not None
    assert busier > bulk
    faster = predict(prompt, BULK, PoolForecast(rate * 2, queued, waiting, 8_192))
    assert faster is not None
    assert faster < bulk


def request(deadline_in_s: float | None) -> InferenceRequest:
    return InferenceRequest.model_validate(
        {
            "request_id": "r1",
            "tenant": "acme",
            "tier": Tier.BASIC,
            "prompt": "a" * 4_000,  # 1,000 tokens
            "reply_to": "replies",
            "created_at": NOW - 1,
            "deadline_at": None if deadline_in_s is None else NOW + deadline_in_s,
        }
    )


@pytest.mark.parametrize(
    ("deadline_in_s", "refused"),
    # predicted: (2,000 queued + 10,000 waiting at or above bulk + 1,000) / 1,000 = 13 s
    [(15.0, False), (10.0, True), (None, False)],
)
def test_a_request_whose_first_token_would_come_after_its_deadline_is_refused_at_once(
    deadline_in_s: float | None, refused: bool
) -> None:
    policy = AdmissionPolicy(PolicyConfig(tiers=DEFAULT_TIERS, pools=("main", "small")))
    ahead = {"main": PoolForecast(1_000.0, 2_000, WAITING, step_tokens=8_192)}
    control = ControlState(ManualClock(NOW))
    got = policy.screen(request(deadline_in_s), BULK, control, NOW, forecasts=ahead)
    if not refused:
        assert isinstance(got, Screened)
        return
    assert isinstance(got, Reply)
    reply = got.reply
    assert (reply.status, reply.reason, reply.code) == (
        ReplyStatus.REJECTED,
        ReasonCode.OVERLOADED,
        "deadline_unreachable",
    )
    assert reply.rate_limit is not None
    assert reply.rate_limit.retry_after_s == 13  # the predicted wait, whole seconds
    # The same request with nothing predicted is screened as before.
    assert isinstance(policy.screen(request(deadline_in_s), BULK, control, NOW), Screened)


def test_the_forecast_reads_the_learned_rates_the_engines_queue_and_the_backlog() -> None:
    cap = FleetCapacity(CapacityConfig())
    for now, pending, done in ((0.0, 3_000, 0), (1.0, 3_000, 5_000)):  # 5,000 tokens/s
        stats = engine_stats(
            "w1", "main", 64, max_num_batched_tokens=8_192, prefill_pending_tokens=pending
        )
        cap.observe(stats.model_copy(update={"prefilled_tokens_total": done}), now=now)
    queues: dict[tuple[Lane, str], deque[Item]] = {
        (VIP, "main"): deque([Item("v", 0.0, Cost(300, 10))]),
        (BULK, "main"): deque([Item("b1", 0.0, Cost(700, 10)), Item("b2", 0.0, Cost(1_000, 10))]),
        (SCAVENGER, "main"): deque([Item("s", 0.0, Cost(9_999, 10))]),  # goes after all
    }
    got = forecasts(queues, ("main", "small"), cap, now=1.0)
    assert got["main"] == PoolForecast(5_000.0, 3_000, {VIP: 300, BULK: 1_700}, 8_192)
    assert got["small"].prefill_rate == 0.0  # no worker: nothing predicted
