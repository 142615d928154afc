"""DAPO soft overlong punishment (eq. 13) and the plain length penalty, hand-computed."""

from __future__ import annotations

import pytest

from posttrain.rewards import (
    LengthUnit,
    VerifierInputError,
    length_penalty,
    overlong_penalty,
    soft_overlong,
)


def test_soft_overlong_matches_eq_13_by_hand():
    # L_max = 20, L_cache = 4 → free up to 16, linear on (16, 20], −1 beyond.
    assert soft_overlong(0, max_len=20, cache=4) == 0.0
    assert soft_overlong(16, max_len=20, cache=4) == 0.0  # |y| = L_max − L_cache: still free
    assert soft_overlong(17, max_len=20, cache=4) == pytest.approx(-0.25, abs=1e-12)  # (16 − 17)/4
    assert soft_overlong(18, max_len=20, cache=4) == pytest.approx(-0.5, abs=1e-12)  # (16 − 18)/4
    assert soft_overlong(20, max_len=20, cache=4) == pytest.approx(-1.0, abs=1e-12)  # (16 − 20)/4: meets −1
    assert soft_overlong(21, max_len=20, cache=4) == -1.0  # truncated
    assert soft_overlong(5, max_len=5, cache=5) == pytest.approx(-1.0, abs=1e-12)  # cache = max: all linear
    assert soft_overlong(2, max_len=5, cache=5) == pytest.approx(-0.4, abs=1e-12)  # (0 − 2)/5


def test_overlong_penalty_takes_token_lengths_from_the_column():
    completions = ["a", "b", "c", "d"]  # the text is ignored when counting tokens
    out = overlong_penalty(completions, lengths=[10, 17, 19, 40], max_len=20, cache=4)
    assert out == pytest.approx([0.0, -0.25, -0.75, -1.0], abs=1e-12)  # (16−17)/4, (16−19)/4


def test_overlong_penalty_counts_characters_without_a_tokenizer():
    completions = ["x" * 3, "x" * 6, "x" * 9]
    out = overlong_penalty(completions, max_len=8, cache=4, count=LengthUnit.CHARS)
    assert out == pytest.approx([0.0, -0.5, -1.0], abs=1e-12)  # 3 ≤ 4; (4 − 6)/4; 9 > 8
    # A lengths column is ignored when counting characters.
    assert overlong_penalty(["xx"], lengths=[99], max_len=8, cache=4, count="chars") == [0.0]


def test_plain_length_penalty():
    out = length_penalty(["a", "b", "c"], lengths=[0, 25, 500], max_len=100)
    assert out == pytest.approx([0.0, -0.25, -1.0], abs=1e-12)  # −0/100, −25/100, capped at −1


def test_missing_lengths_is_a_clear_error_not_a_silent_char_count():
    with pytest.raises(VerifierInputError, match="count='tokens' needs a lengths"):
        overlong_penalty(["abc"], max_len=8, cache=4)
    with pytest.raises(VerifierInputError, match=r"lengths\[1\] = -3"):
        length_penalty(["a", "b"], lengths=[1, -3], max_len=8)
    with pytest.raises(VerifierInputError, match="column 'lengths' has 1 entries for 2"):
        length_penalty(["a", "b"], lengths=[1], max_len=8)


@pytest.mark.parametrize(
    ("max_len", "cache", "message"),
    [(0, 1, "max_len"), (8, 0, "cache"), (8, 9, "cache"), (8.0, 2, "max_len")],
)
def test_bad_overlong_parameters(max_len, cache, message):
    with pytest.raises(VerifierInputError, match=message):
        overlong_penalty(["a"], lengths=[1], max_len=max_len, cache=cache)
