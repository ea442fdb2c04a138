"""The fetch wait while records flow and when idle (pure, the clock injected)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seawall_client.fetch_pacing import FetchPacing
from seawall_client.kafka import KafkaConfig


def test_the_wait_is_long_until_records_come() -> None:
    pacing = FetchPacing(idle_ms=50, busy_ms=10, busy_window_s=0.5)
    assert pacing.wait_ms(False, 0.0) == 50
    assert pacing.wait_ms(True, 1.0) == 10


def test_the_wait_stays_short_for_the_window_after_the_last_records() -> None:
    pacing = FetchPacing(idle_ms=50, busy_ms=10, busy_window_s=0.5)
    pacing.wait_ms(True, 1.0)
    assert pacing.wait_ms(False, 1.49) == 10
    assert pacing.wait_ms(False, 1.5) == 50
    assert pacing.wait_ms(True, 2.0) == 10


@given(
    reads=st.lists(st.tuples(st.booleans(), st.floats(0.0, 2.0)), max_size=40),
    window=st.floats(0.01, 1.0),
)
def test_the_wait_is_short_exactly_within_the_window_after_records(
    reads: list[tuple[bool, float]], window: float
) -> None:
    pacing = FetchPacing(idle_ms=50, busy_ms=10, busy_window_s=window)
    now, last = 0.0, None
    for got, step in reads:
        now += step
        if got:
            last = now
        busy = last is not None and now - last < window
        assert pacing.wait_ms(got, now) == (10 if busy else 50)


@pytest.mark.parametrize(("idle", "busy"), [(50, 0), (50, 51), (10, 20)])
def test_a_busy_wait_outside_one_ms_and_the_idle_wait_is_refused(idle: int, busy: int) -> None:
    with pytest.raises(ValueError, match="busy wait"):
        FetchPacing(idle_ms=idle, busy_ms=busy)


def test_a_client_reads_the_busy_wait_as_the_services_do() -> None:
    env = {"SEAWALL_CONSUMER_FETCH_MAX_WAIT_MS": "40", "SEAWALL_CONSUMER_FETCH_BUSY_WAIT_MS": "8"}
    config = KafkaConfig.from_env(env)
    assert (config.fetch_max_wait_ms, config.fetch_busy_wait_ms) == (40, 8)
    assert KafkaConfig.from_env({}).fetch_busy_wait_ms is None
    with pytest.raises(ValueError, match="busy wait"):
        KafkaConfig.from_env({**env, "SEAWALL_CONSUMER_FETCH_BUSY_WAIT_MS": "41"})


# -- dormancy (a doorbell wakes the consumer) -----------------------------------------
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from seawall_client.fetch_pacing import Dormancy  # noqa: E402


def test_a_consumer_starts_awake_then_sleeps_after_its_linger() -> None:
    d = Dormancy(awake_ms=10)
    assert d.linger_s == pytest.approx(0.015)  # the fetch wait and a margin
    assert d.awake(False, now=100.0)  # starting: catch up first
    assert d.awake(False, now=100.01)
    assert not d.awake(False, now=100.02)
    assert d.next_look() == pytest.approx(100.02 + d.peek_s)


def test_records_and_rings_keep_it_awake_for_a_linger_each() -> None:
    d = Dormancy(awake_ms=10, linger_s=0.05)
    d.awake(False, now=0.0)
    assert not d.awake(False, now=1.0)
    d.woken(2.0)
    assert d.awake(False, now=2.04)
    assert d.awake(True, now=2.04)  # records: another linger from here
    assert d.awake(False, now=2.08)
    assert not d.awake(False, now=2.1)


def test_a_dormant_consumer_peeks_every_peek_s() -> None:
    d = Dormancy(awake_ms=10, linger_s=0.05, peek_s=5.0)
    d.awake(False, now=0.0)
    assert not d.awake(False, now=1.0)
    assert not d.awake(False, now=5.9)
    assert d.awake(False, now=6.0)  # five seconds asleep: a peek
    assert d.awake(False, now=6.04)
    assert not d.awake(False, now=6.1)
    assert d.next_look() == pytest.approx(6.1 + 5.0)


@given(st.lists(st.tuples(st.floats(0.0, 3.0), st.booleans(), st.booleans()), max_size=60))
def test_a_ring_is_never_slept_through(steps: list[tuple[float, bool, bool]]) -> None:
    """Looking again whenever ``next_look`` says (as the consumer's timer does): a
    consumer is awake for a linger after any ring or records, and never sleeps longer
    than ``peek_s`` without a fetch."""
    d = Dormancy(awake_ms=10, linger_s=0.05, peek_s=1.0)
    now = last_awake = 0.0
    assert d.awake(False, now)

    def advance(to: float) -> None:
        nonlocal last_awake
        while d.next_look() <= to:
            at = d.next_look()
            if d.awake(False, at):
                last_awake = at
            assert at - last_awake <= (d.linger_s or 0) + d.peek_s + 1e-9

    for gap, ring, records in steps:
        advance(now + gap)
        now += gap
        if ring:
            d.woken(now)
        if d.awake(records, now):
            last_awake = now
        if ring or records:
            assert d.awake(False, now + 0.049)


def test_dormancy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="awake_ms"):
        Dormancy(awake_ms=0)
    with pytest.raises(ValueError, match="positive"):
        Dormancy(awake_ms=10, peek_s=0)


async def test_a_consumer_woken_before_it_starts_does_not_fail_its_look() -> None:
    """A doorbell subscribes, and wakes its consumers, as soon as it learns their
    topics, which can be before a consumer has started (and has a fetcher): the look
    the wake schedules used to raise in the event loop then (``fetcher._records`` on
    None, seen in admission's log under load)."""
    from seawall_client.fetch_pacing import Dormancy
    from seawall_client.kafka import KafkaConfig, new_consumer

    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        consumer = new_consumer(
            KafkaConfig(bootstrap="127.0.0.1:9"), "llm.requests.high", dormancy=Dormancy(5)
        )
        consumer.wake()
        consumer._look_again()
        await asyncio.sleep(0.05)
    finally:
        loop.set_exception_handler(None)
    assert errors == []
