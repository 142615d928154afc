"""Unbiased pass@k (Chen et al. 2021), its naive twin, per-level aggregation, standard errors."""

from __future__ import annotations

import pytest

from posttrain.rewards import (
    ProblemOutcome,
    pass_at_k,
    pass_at_k_by_level,
    pass_at_k_naive,
    stderr_of_mean,
)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # 1 − C(3,1)/C(5,1) = 1 − 3/5: pass@1 is c/n
        (5, 2, 2, 0.7),  # 1 − C(3,2)/C(5,2) = 1 − 3/10; product form (1 − 2/4)(1 − 2/5) = 0.3
        (4, 1, 2, 0.5),  # 1 − C(3,2)/C(4,2) = 1 − 3/6
        (5, 2, 4, 1.0),  # n − c = 3 < k = 4: every 4-subset holds a correct sample
        (10, 0, 5, 0.0),  # nothing correct
        (1, 1, 1, 1.0),  # one greedy sample, correct
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k_naive(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_product_form_agrees_with_exact_binomials():
    worst = 0.0
    for n in range(1, 31):
        for c in range(n + 1):
            for k in range(1, n + 1):
                worst = max(worst, abs(pass_at_k(n, c, k) - pass_at_k_naive(n, c, k)))
    assert worst < 1e-12
    # Large n, where C(n, k) has ~140 digits: the product form needs no big numbers.
    assert pass_at_k(1000, 3, 100) == pytest.approx(pass_at_k_naive(1000, 3, 100), abs=1e-12)
    assert pass_at_k(1000, 3, 100) == pytest.approx(0.2712, abs=1e-4)  # 1 − (900·899·898)/(1000·999·998)


def test_bad_counts_are_clear_errors():
    with pytest.raises(ValueError, match=r"k must be an int in \[1, n=4\]"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match=r"c \(correct samples\) must be an int in \[0, n=4\]"):
        pass_at_k(4, 5, 1)


def test_stderr_of_mean_by_hand():
    # [1, 0, 1, 1]: mean 0.75, Σ(v − m)² = 0.75, s² = 0.75/3 = 0.25, SE = √(0.25/4) = 0.25
    # = binomial √(p(1−p)/(N−1)) = √(0.1875/3) = 0.25
    assert stderr_of_mean([1.0, 0.0, 1.0, 1.0]) == pytest.approx(0.25, abs=1e-12)
    assert stderr_of_mean([0.5]) is None  # one problem: no spread to estimate


def test_per_level_aggregation_by_hand():
    outcomes = [
        ProblemOutcome(n=4, c=4, level="easy"),
        ProblemOutcome(n=4, c=0, level="hard"),
        ProblemOutcome(n=4, c=2, level="easy"),
        ProblemOutcome(n=4, c=1, level="hard"),
    ]
    rows = pass_at_k_by_level(outcomes, ks=(1, 2))
    got = [(r.level, r.metric, round(r.value, 6), r.n_problems) for r in rows]
    assert got == [
        ("easy", "pass@1", 0.75, 2),  # (1 + 0.5)/2
        ("easy", "pass@2", 0.916667, 2),  # (1 + (1 − C(2,2)/C(4,2) = 5/6))/2 = 11/12
        ("hard", "pass@1", 0.125, 2),  # (0 + 0.25)/2
        ("hard", "pass@2", 0.25, 2),  # (0 + (1 − C(3,2)/C(4,2) = 0.5))/2
        (None, "pass@1", 0.4375, 4),  # (1 + 0 + 0.5 + 0.25)/4
        (None, "pass@2", 0.583333, 4),  # (1 + 0 + 5/6 + 0.5)/4
    ]
    assert rows[0].stderr == pytest.approx(0.25, abs=1e-12)  # [1, 0.5]: s² = 0.125, √(0.125/2)
    record = rows[0].as_eval_record(stage="grpo", checkpoint="checkpoints/grpo", eval="arithmetic")
    assert record == {
        "stage": "grpo",
        "checkpoint": "checkpoints/grpo",
        "eval": "arithmetic",
        "level": "easy",
        "metric": "pass@1",
        "value": 0.75,
        "n": 2,
        "stderr": pytest.approx(0.25, abs=1e-12),
    }


def test_per_level_errors():
    with pytest.raises(ValueError, match="problem 1 of level 'x' has only n=2 samples"):
        pass_at_k_by_level([ProblemOutcome(4, 1, "x"), ProblemOutcome(2, 1, "x")], ks=(4,))
    with pytest.raises(ValueError, match="no problem outcomes"):
        pass_at_k_by_level([], ks=(1,))
    only_pooled = pass_at_k_by_level([ProblemOutcome(2, 1), ProblemOutcome(2, 2)], ks=(1,))
    assert [(r.level, r.value) for r in only_pooled] == [(None, 0.75)]  # (0.5 + 1)/2
