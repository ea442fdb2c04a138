from __future__ import annotations

import pytest

from services.common.tokenizer import count_tokens
from services.workers.engine.sim import WORDS

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("", 0),
        ("   \n\t", 0),
        ("hello world", 2),
        ("Hello, world!", 4),
        ("internationalization", 5),
        ("你好世界", 4),
        ("订单12345678", 4),
        ("a_b", 3),
    ],
)
def test_count_tokens(text: str, tokens: int) -> None:
    assert count_tokens(text) == tokens


def test_longer_text_counts_more() -> None:
    assert count_tokens("word " * 100) == 100
    assert count_tokens("x" * 400) == 100


def test_every_simulated_word_is_one_token() -> None:
    assert all(count_tokens(word) == 1 for word in WORDS)
    assert count_tokens(" ".join(WORDS)) == len(WORDS)
