from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.tokenizer import _PIECES, count_tokens
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


def _reference(text: str) -> int:
    """The module's rules, piece by piece."""
    return sum(max(1, (len(p) + 2) // 4) for p in _PIECES.findall(text))


@given(
    st.lists(
        st.one_of(
            st.sampled_from([" ", "\n", ",", "_", "你", "ア", "한", "😀", "٣", "x"]),
            st.integers(1, 300).map(lambda n: "a" * n),  # past the table's 255 too
        ),
        max_size=20,
    ).map("".join)
)
def test_the_lookup_by_length_counts_as_the_rules_do(text: str) -> None:
    assert count_tokens(text) == _reference(text)
