"""When ``seawall up`` warns that the embedded broker has filled up (pure parts)."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition
from hypothesis import given
from hypothesis import strategies as st

from seawall.broker_fill import Fill, FillAlarm, fill_of, warning

pytestmark = pytest.mark.unit


def test_the_first_warning_comes_at_the_threshold_and_the_next_at_each_doubling() -> None:
    alarm = FillAlarm(first=100)
    assert [alarm.passed(n) for n in (0, 99, 100, 150, 199, 200, 399, 400, 800)] == [
        False,
        False,
        True,
        False,
        False,
        True,
        False,
        True,
        True,
    ]


def test_a_jump_past_several_thresholds_warns_once() -> None:
    alarm = FillAlarm(first=100)
    assert alarm.passed(1_000)
    assert not alarm.passed(1_000)
    assert not alarm.passed(1_599)
    assert alarm.passed(1_600)


def test_the_first_threshold_is_at_least_one_record() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FillAlarm(first=0)


def _level(records: int, first: int) -> int:
    """How many doublings of ``first`` ``records`` reached (-1: not even ``first``)."""
    level = -1
    while records >= first << (level + 1):
        level += 1
    return level


@given(
    st.integers(min_value=1, max_value=5_000),
    st.lists(st.integers(min_value=0, max_value=10**7), max_size=40),
)
def test_it_warns_exactly_when_a_reading_reaches_a_doubling_no_earlier_one_reached(
    first: int, readings: list[int]
) -> None:
    alarm = FillAlarm(first)
    highest = -1
    for records in readings:
        level = _level(records, first)
        assert alarm.passed(records) == (level > highest)
        highest = max(highest, level)


def test_the_fill_counts_every_partition_and_names_the_fullest() -> None:
    ends = {
        TopicPartition("llm.telemetry", 0): 40,
        TopicPartition("llm.reply.t", 0): 900,
        TopicPartition("llm.ingress", 2): 900,
        TopicPartition("llm.ingress", 1): 12,
    }
    # ties: topic, then partition
    assert fill_of(ends) == Fill(1_852, "llm.ingress", 2, 900)
    assert fill_of({}) is None


def test_the_warning_says_how_full_where_and_what_to_do() -> None:
    text = warning(Fill(61_234, "llm.reply.acme", 0, 12_345))
    assert "holds about 61,234 records, 12,345 of them in llm.reply.acme[0]" in text
    assert "Restart `seawall up`" in text
    assert "SEAWALL_KAFKA_BOOTSTRAP" in text
