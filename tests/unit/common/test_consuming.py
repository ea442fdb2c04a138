"""The shared consumer discipline without a broker: every record of a batch is settled —
its effect applied, or answered/dead-lettered when it fails on its own account — and
only an unavailable broker or Redis makes a record wait and go again."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import redis.exceptions
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NodeNotReadyError,
    UnknownTopicOrPartitionError,
)
from aiokafka.structs import ConsumerRecord
from hypothesis import given
from hypothesis import strategies as st

from seawall_client.serde import DecodeError
from services.common.consuming import ConsumerLoop, Record, retry_unavailable
from services.common.failures import Backoff, StoreUnavailable, is_infrastructure

pytestmark = pytest.mark.unit


def record(offset: int, value: bytes = b"v", partition: int = 0) -> Record:
    return ConsumerRecord(
        topic="t",
        partition=partition,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=None,
        value=value,
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=len(value),
        headers=(),
    )


class Script:
    """A handler whose every step follows a script: per (step, offset), how many times
    it fails first and with what."""

    def __init__(self, failures: dict[tuple[str, int], list[BaseException]] | None = None):
        self.failures = failures or {}
        self.applied: list[int] = []
        self.answered: list[tuple[int, str]] = []
        self.decided: list[int] = []

    def _maybe_fail(self, step: str, offset: int) -> None:
        queue = self.failures.get((step, offset))
        if queue:
            raise queue.pop(0)

    async def decide(self, r: Record) -> int:
        self.decided.append(r.offset)
        self._maybe_fail("decide", r.offset)
        return r.offset

    async def effect(self, r: Record, decision: int) -> asyncio.Future[Any] | None:
        self._maybe_fail("effect", r.offset)
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        queue = self.failures.get(("ack", r.offset))
        if queue:
            ack.set_exception(queue.pop(0))
        else:
            self.applied.append(decision)
            ack.set_result(None)
        return ack

    async def fail(self, r: Record, error: BaseException) -> None:
        self._maybe_fail("fail", r.offset)
        self.answered.append((r.offset, type(error).__name__))


class Letters:
    def __init__(self) -> None:
        self.sent: list[tuple[int, str]] = []

    async def record(self, r: Record, error: BaseException) -> None:
        self.sent.append((r.offset, type(error).__name__))


def loop(
    handler: Script, letters: Letters | None = None, concurrency: int = 4
) -> ConsumerLoop[int]:
    return ConsumerLoop(
        consumer=None,  # type: ignore[arg-type]  # settle() never touches it
        handler=handler,
        dead_letters=letters,  # type: ignore[arg-type]
        name="test",
        commit=False,
        concurrency=concurrency,
        backoff=Backoff(base_s=0.001, cap_s=0.002, rng=random.Random(0)),
    )


UNAVAILABLE = [
    KafkaConnectionError(),
    KafkaTimeoutError(),
    NodeNotReadyError(),
    redis.exceptions.ConnectionError("refused"),
    redis.exceptions.TimeoutError(),
    StoreUnavailable("down"),
    ConnectionRefusedError(),
    TimeoutError(),
]
OWN = [
    DecodeError("invalid_json", "bad"),
    MessageSizeTooLargeError(),
    UnknownTopicOrPartitionError(),
    ValueError("x"),
    KeyError("k"),
    RuntimeError("bug"),
]


@pytest.mark.parametrize("error", UNAVAILABLE, ids=lambda e: type(e).__name__)
def test_unavailability_is_infrastructure(error: BaseException) -> None:
    assert is_infrastructure(error)


@pytest.mark.parametrize("error", OWN, ids=lambda e: type(e).__name__)
def test_everything_else_is_the_records_own(error: BaseException) -> None:
    assert not is_infrastructure(error)


async def test_a_record_failing_on_its_own_account_is_answered_and_the_rest_applied() -> None:
    handler = Script({("decide", 1): [ValueError("bad")], ("ack", 3): [MessageSizeTooLargeError()]})
    await loop(handler).settle([record(i) for i in range(5)])
    assert handler.applied == [0, 2, 4]
    assert handler.answered == [(1, "ValueError"), (3, "MessageSizeTooLargeError")]


async def test_an_unavailable_store_makes_only_its_records_wait_and_go_again() -> None:
    handler = Script(
        {
            ("decide", 2): [redis.exceptions.ConnectionError("down")] * 3,
            ("ack", 4): [KafkaTimeoutError()],
        }
    )
    await loop(handler).settle([record(i) for i in range(6)])
    assert sorted(handler.applied) == list(range(6))
    assert handler.decided.count(2) == 4
    assert handler.decided.count(4) == 2
    assert handler.decided.count(0) == 1  # a settled record is not done again
    assert handler.answered == []


async def test_an_answer_that_fails_on_its_own_account_becomes_a_dead_letter() -> None:
    handler = Script({("decide", 0): [ValueError("bad")], ("fail", 0): [RuntimeError("no")]})
    letters = Letters()
    await loop(handler, letters).settle([record(0), record(1)])
    assert letters.sent == [(0, "ValueError")]
    assert handler.applied == [1]


async def test_an_answer_that_meets_an_outage_is_tried_again() -> None:
    handler = Script({("decide", 0): [ValueError("bad")] * 2, ("fail", 0): [KafkaTimeoutError()]})
    await loop(handler).settle([record(0)])
    assert handler.answered == [(0, "ValueError")]


async def test_one_at_a_time_keeps_record_order() -> None:
    order: list[int] = []

    class Slow(Script):
        async def decide(self, r: Record) -> int:
            await asyncio.sleep(0.001 * (10 - r.offset))  # later records would finish first
            order.append(r.offset)
            return r.offset

    await loop(Slow(), concurrency=1).settle([record(i) for i in range(10)])
    assert order == list(range(10))


async def test_fan_out_is_bounded_by_the_concurrency() -> None:
    running = 0
    peak = 0

    class Counting(Script):
        async def decide(self, r: Record) -> int:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.001)
            running -= 1
            return r.offset

    await loop(Counting(), concurrency=3).settle([record(i) for i in range(50)])
    assert peak == 3


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["decide", "effect", "ack"]),
            st.integers(0, 7),
            st.sampled_from(["unavailable", "own"]),
        ),
        max_size=12,
    )
)
def test_every_record_is_settled_exactly_once_whatever_fails(
    plan: list[tuple[str, int, str]],
) -> None:
    failures: dict[tuple[str, int], list[BaseException]] = {}
    for step, offset, kind in plan:
        error: BaseException = KafkaTimeoutError() if kind == "unavailable" else ValueError()
        failures.setdefault((step, offset), []).append(error)
    handler = Script(failures)
    asyncio.run(loop(handler).settle([record(i) for i in range(8)]))
    settled = handler.applied + [offset for offset, _ in handler.answered]
    assert sorted(settled) == list(range(8))


async def test_retry_unavailable_retries_outages_and_raises_the_rest() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise redis.exceptions.TimeoutError()
        return "ok"

    backoff = Backoff(base_s=0.001, cap_s=0.001)
    assert await retry_unavailable(flaky, backoff) == "ok"
    assert (calls, backoff.failures) == (3, 0)

    async def broken() -> None:
        raise ValueError("its own")

    with pytest.raises(ValueError, match="its own"):
        await retry_unavailable(broken, backoff)


def test_backoff_is_full_jitter_under_a_doubling_cap() -> None:
    b = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(7))
    delays = [b.next_delay() for _ in range(8)]
    caps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    assert all(0 <= d <= c for d, c in zip(delays, caps, strict=True))
    assert len(set(delays)) == len(delays)  # jittered, not fixed steps
    b.reset()
    assert b.next_delay() <= 0.1
    with pytest.raises(ValueError, match="base_s"):
        Backoff(base_s=0)
