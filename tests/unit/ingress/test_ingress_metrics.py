"""The rolling long-prompt share."""

from __future__ import annotations

import pytest

from seawall_client.clock import ManualClock
from services.ingress.metrics import LongPromptShare
from services.ingress.policy.filters.prompt_length import LONG_PROMPT_TOKENS

pytestmark = pytest.mark.unit


def test_share_over_the_window() -> None:
    clock = ManualClock()
    share = LongPromptShare(window_s=60, clock=clock)
    assert share.share() == 0.0
    assert share.observe(LONG_PROMPT_TOKENS + 1) == 1.0
    assert share.observe(LONG_PROMPT_TOKENS) == 0.5  # 4096 itself is not long
    clock.advance(30)
    assert share.observe(10) == pytest.approx(1 / 3)
    clock.advance(30.5)  # the first one-second slot is still (partly) in the window
    assert share.share() == pytest.approx(1 / 3)
    clock.advance(0.5)  # now it has left
    assert share.observe(LONG_PROMPT_TOKENS * 2) == 0.5
    clock.advance(120)
    assert share.share() == 0.0


@pytest.mark.parametrize(("window_s", "resolution_s"), [(0, 1), (60, -1)])
def test_window_and_resolution_must_be_positive(window_s: float, resolution_s: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        LongPromptShare(window_s, resolution_s)


def test_the_reading_agrees_with_the_share_and_decays_without_traffic() -> None:
    clock = ManualClock()
    share = LongPromptShare(window_s=60, clock=clock)
    for tokens in (LONG_PROMPT_TOKENS + 1, 10, 10, LONG_PROMPT_TOKENS * 3):
        share.observe(tokens)
        clock.advance(7.3)
        assert share.reading() == share.share()
    assert share.reading() == 0.5
    clock.advance(61)  # no prompt since: the share falls to nothing by itself
    assert share.reading() == 0.0
