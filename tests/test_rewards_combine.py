"""Weighted combination, None handling, error counting, and the verifier registry."""

from __future__ import annotations

import pytest

from posttrain.rewards import (
    Scores,
    Skip,
    VerifierInputError,
    VerifierName,
    WeightedVerifier,
    build_verifier,
    combine,
)


def constant(values):
    def verifier(completions, **_):
        return values if isinstance(values, Scores) else list(values)  # keep a Scores' reasons

    return verifier


def test_weighted_sum_by_hand():
    acc = WeightedVerifier("accuracy", constant([1.0, 0.0, 1.0]), weight=1.0)
    fmt = WeightedVerifier("format", constant([1.0, 1.0, 0.0]), weight=0.5)
    out = combine([acc, fmt], ["a", "b", "c"])
    assert out.total == pytest.approx([1.5, 0.5, 1.0], abs=1e-12)  # 1+0.5·1, 0+0.5·1, 1+0.5·0
    assert out.per_verifier == {"accuracy": [1.0, 0.0, 1.0], "format": [1.0, 1.0, 0.0]}  # unweighted
    assert out.stats["accuracy"].mean == pytest.approx(2 / 3, abs=1e-12)
    assert out.skipped == 0


def test_none_skips_the_item_and_is_counted_never_zero():
    acc = WeightedVerifier(
        "accuracy",
        constant(Scores([1.0, None, None, 0.0], [None, Skip.TIMEOUT, Skip.UNJUDGEABLE, None])),
    )
    fmt = WeightedVerifier("format", constant([1.0, 1.0, 1.0, 1.0]), weight=0.1)
    out = combine([acc, fmt], ["a", "b", "c", "d"])
    assert out.total == pytest.approx([1.1, None, None, 0.1], abs=1e-12)  # None vetoes; 0 + 0.1·1
    stats = out.stats["accuracy"]
    assert (stats.scored, stats.none, stats.unjudgeable, stats.timeouts, stats.errors) == (2, 2, 1, 1, 1)
    assert stats.mean == pytest.approx(0.5, abs=1e-12)  # mean of the judged 1.0 and 0.0 only
    assert out.skipped == 2


def test_weight_zero_verifier_is_logged_but_never_vetoes():
    acc = WeightedVerifier("accuracy", constant([1.0, 0.0]))
    monitor = WeightedVerifier("monitor", constant([None, 0.25]), weight=0.0)
    out = combine([acc, monitor], ["a", "b"])
    assert out.total == [1.0, 0.0]
    assert out.per_verifier["monitor"] == [None, 0.25]
    assert out.stats["monitor"].unjudgeable == 1  # a plain list's None counts as unjudgeable


def test_a_raising_verifier_is_counted_as_errors_not_wrong_answers():
    def broken(completions, **_):
        raise RuntimeError("sandbox unreachable")

    out = combine(
        [WeightedVerifier("accuracy", constant([1.0, 0.0])), WeightedVerifier("code", broken)], ["a", "b"]
    )
    assert out.total == [None, None]
    assert out.per_verifier["code"] == [None, None]
    stats = out.stats["code"]
    assert (stats.errors, stats.timeouts, stats.scored) == (2, 0, 0)
    assert stats.first_error == "RuntimeError: sandbox unreachable"
    metrics = out.metrics()
    assert metrics["reward/code/errors"] == 2.0 and metrics["reward/skipped"] == 2.0
    assert metrics["reward/accuracy"] == pytest.approx(0.5, abs=1e-12)
    assert "reward/total" not in metrics  # nothing was judged by all verifiers


def test_configuration_errors_are_raised_not_counted():
    def picky(completions, **_):
        raise ValueError("code verifier: column `tests` must hold one entry per completion")

    with pytest.raises(ValueError, match="column `tests`"):
        combine([WeightedVerifier("code", picky)], ["a"])  # ValueError = bad input: stops the run
    math_like = WeightedVerifier("math", build_verifier("math"))
    with pytest.raises(VerifierInputError, match="verifier 'math' cannot take columns"):
        combine([math_like], ["38"])  # the answer column is missing
    with pytest.raises(VerifierInputError, match="column 'answer' has 2 entries for 1 completions"):
        combine([math_like], ["38"], answer=["38", "39"])
    with pytest.raises(VerifierInputError, match="returned 1 scores for 2"):
        combine([WeightedVerifier("short", constant([1.0]))], ["a", "b"])
    with pytest.raises(VerifierInputError, match="names must be unique"):
        combine([WeightedVerifier("x", constant([1.0]))] * 2, ["a"])


def test_registry_builds_every_local_verifier_and_they_combine():
    verifiers = [
        WeightedVerifier("math", build_verifier("math", timeout_s=5.0), weight=1.0),
        WeightedVerifier("format", build_verifier("format", think="optional"), weight=0.2),
        WeightedVerifier("overlong", build_verifier("overlong", max_len=20, cache=4), weight=1.0),
        WeightedVerifier("length", build_verifier(VerifierName.LENGTH, max_len=100), weight=0.0),
    ]
    completions = ["<think>19*2=38</think> 38", "38", "<think>19*2=38</think> 39 junk"]
    out = combine(verifiers, completions, answer=["38", "38", "38"], lengths=[10, 18, 30])
    # math 1, 1, 0; format 1, 1, 0; overlong 0, (16−18)/4 = −0.5, −1
    assert out.per_verifier["math"] == [1.0, 1.0, 0.0]
    assert out.per_verifier["format"] == [1.0, 1.0, 0.0]
    assert out.per_verifier["overlong"] == pytest.approx([0.0, -0.5, -1.0], abs=1e-12)
    assert out.total == pytest.approx([1.2, 0.7, -1.0], abs=1e-12)  # 1+0.2+0, 1+0.2−0.5, 0+0−1


def test_registry_errors_name_what_and_what_was_expected():
    with pytest.raises(VerifierInputError, match="unknown verifier 'maths'; expected one of: math, format"):
        build_verifier("maths")
    with pytest.raises(VerifierInputError, match="verifier 'overlong': unknown parameter 'l_max'"):
        build_verifier("overlong", l_max=10, cache=2)
    with pytest.raises(VerifierInputError, match="verifier 'overlong': missing required parameter"):
        build_verifier("overlong", max_len=10)
    with pytest.raises(VerifierInputError, match="length count 'words'"):
        build_verifier("length", max_len=10, count="words")
    with pytest.raises(VerifierInputError, match="cache"):
        build_verifier("overlong", max_len=10, cache=11)
    with pytest.raises(VerifierInputError, match="verifier 'code': unknown parameter 'backnd'"):
        build_verifier("code", backnd="bubblewrap")  # checked before any sandbox is opened


def test_code_verifier_sandbox_failures_count_as_errors():
    from posttrain.rewards.registry import _SandboxFailuresAreErrors

    wrapped = _SandboxFailuresAreErrors(constant([1.0, None, 0.0]))  # None = the sandbox failed
    out = combine([WeightedVerifier("code", wrapped)], ["a", "b", "c"], tests=[[], [], []])
    stats = out.stats["code"]
    assert (stats.scored, stats.errors, stats.unjudgeable) == (2, 1, 0)
