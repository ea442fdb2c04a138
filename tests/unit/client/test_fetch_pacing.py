"""The fetch wait while records flow and when idle (pure, the clock injected)."""

from __future__ import annotations

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
