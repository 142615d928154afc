"""Math verifier: golden positives/negatives, the integer fast path, the hard timeout, threads."""

from __future__ import annotations

import os
import threading
import time

import pytest

from posttrain.rewards import MathVerifier, Skip, VerifierInputError
from posttrain.rewards.math_verifier import (
    as_integer,
    is_number_literal,
    normalize_gold,
)

# A pred that hangs math-verify's verify() for many seconds (sympy tries to compare 10^(10^10)).
HANG = "<think>huge</think> \\boxed{10^{10^{10}}}"
SYMBOLIC_GOLD = "2\\sqrt{3}"  # not a number literal, so the literal guard lets the hang through

# (completion, gold, expected score); each line says why.
POSITIVES = [
    ("<think>12+7=19, 19*2=38</think> 38", "38"),  # the arithmetic world, R1 shape
    ("38", "38"),  # easy problem answered directly
    ("<think>5-17=-12</think> -12", "-12"),  # negative integer
    ("<think>19*2=38</think>\n\n38.", "38"),  # trailing period is punctuation, not junk
    ("<think>19*2=38</think> \\boxed{38}", "38"),  # boxed
    ("<think>19*2=38</think> The answer is $\\boxed{38}$.", "38"),  # prose + boxed, in math mode
    ("<think>sum</think> 1,234", "1234"),  # thousands separator, plain
    ("<think>sum</think> 1,234,567", "1234567"),  # two separators
    ("<think>sum</think> $1{,}234$", "1234"),  # LaTeX thousands separator → math-verify
    ("<think>ratio</think> \\frac{3}{4}", "3/4"),  # LaTeX fraction vs plain gold
    ("<think>ratio</think> 3/4", "\\frac{3}{4}"),  # plain fraction vs LaTeX gold
    ("<think>ratio</think> 0.75", "3/4"),  # decimal vs fraction
    ("<think>ratio</think> $\\dfrac{6}{8}$", "0.75"),  # unreduced LaTeX fraction vs decimal
    ("<think>half</think> -\\frac{1}{2}", "-0.5"),  # signed fraction vs signed decimal
    ("38.0", "38"),  # decimal form of an integer (not the fast path: goes to math-verify)
    ("<think>root</think> $2\\sqrt{3}$", "\\sqrt{12}"),  # symbolic, LaTeX both sides
    ("<think>set</think> \\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces inside a box
    ("\\boxed{38}", "\\boxed{38}"),  # a boxed gold is unwrapped like an answer
]

NEGATIVES = [
    ("<think>12+7=19, 19*2=38</think> 39", "38"),  # plain wrong
    ("<think>ratio</think> 0.7", "3/4"),  # wrong decimal
    ("<think>third</think> 0.333", "1/3"),  # 3 decimals is not 1/3 (math-verify rounds to 6)
    ("<think>sum</think> 12,34", "1234"),  # malformed grouping is not 1234
    ("<think>12+7=19, 19*2=38</think>", "38"),  # missing answer
    ("<think>12+7=19, 19*2=38", "38"),  # reasoning never closed: no answer
    ("", "38"),  # empty completion
    ("<think>19*2=38</think> 38 39", "38"),  # two answers
    ("<think>19*2=38</think> 38 or 39", "38"),  # two answers, hedged
    ("<think>19*2=38</think> 38\n39", "38"),  # two answers on two lines
    ("<think>19*2=38</think> $38$ or $39$", "38"),  # two math segments
    ("<think>19*2=38</think> \\boxed{38} \\boxed{39}", "38"),  # two different boxes
    ("<think>19*2=38</think> 38 is my final answer", "38"),  # trailing junk
    ("<think>19*2=38</think> \\boxed{38} because 19*2=38", "38"),  # trailing junk after the box
    ("<think>19*2=38</think> 38<|im_end|>", "38"),  # left-over special token
    ("<think>a</think> 38 <think>b</think> 38", "38"),  # a second think block
    ("<think>the answer is \\boxed{38}</think>", "38"),  # answer only inside the reasoning
    ("<think>19*2=38 so 38</think> I am not sure", "38"),  # answer only inside the reasoning
    ("The answer is 38", "38"),  # prose, no declared answer
    ("<think>restate</think> 12+7", "19"),  # restating the question is not an answer (literal guard)
    ("<think>assign</think> x=38", "38"),  # not a number literal for a number gold
]


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=5.0) as v:
        yield v


def test_golden_positives_score_one(verifier):
    completions, golds = zip(*POSITIVES)
    scores = verifier(list(completions), answer=list(golds))
    wrong = [(c, g, s) for c, g, s in zip(completions, golds, scores) if s != 1.0]
    assert wrong == []  # every positive scores exactly 1.0
    assert scores.reasons == [None] * len(POSITIVES)


def test_golden_negatives_score_zero(verifier):
    completions, golds = zip(*NEGATIVES)
    scores = verifier(list(completions), answer=list(golds))
    wrong = [(c, g, s) for c, g, s in zip(completions, golds, scores) if s != 0.0]
    assert wrong == []  # every negative scores exactly 0.0 (judged wrong, not skipped)


def test_literal_guard_is_what_rejects_a_restated_question():
    # math-verify evaluates 12+7 = 19, so without the guard the restatement is paid 1.0.
    with MathVerifier(timeout_s=5.0, literal_numbers=False) as loose:
        assert loose(["<think>restate</think> 12+7"], answer=["19"]) == [1.0]


def test_integer_fast_path_agrees_with_math_verify(verifier):
    completions = ["38", "-12", "1,234", "<think>x</think> 0", "007", "39", "-38", "12,34", "+5"]
    golds = ["38", "-12", "1234", "0", "7", "38", "38", "1234", "5"]
    # expected: 1, 1, 1, 1, 1 (leading zeros), 0, 0 (sign), 0 (bad grouping), 1 (explicit plus)
    expected = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    before = verifier.counters["pooled"]
    fast = verifier(completions, answer=golds)
    assert verifier.counters["pooled"] == before  # all decided in-process: no worker round trip
    with MathVerifier(timeout_s=5.0, integer_fast_path=False) as slow_verifier:
        slow = slow_verifier(completions, answer=golds)
        assert slow_verifier.counters["pooled"] == 8  # all but "12,34" (literal guard) went to math-verify
    assert list(fast) == expected
    assert list(slow) == expected


def test_unjudgeable_gold_is_none_never_zero(verifier):
    scores = verifier(["38", "38", "38", "38"], answer=[None, "", "\\boxed{}", "}{"])
    # None / blank / empty box / unparseable by math-verify: cannot judge → None, reason unjudgeable
    assert list(scores) == [None, None, None, None]
    assert scores.reasons == [Skip.UNJUDGEABLE] * 4


def test_int_gold_column_is_accepted(verifier):
    assert verifier(["38", "-3"], answer=[38, -3]) == [1.0, 1.0]  # worlds may store golds as ints


def test_hanging_parser_is_cut_off_by_the_timeout():
    with MathVerifier(timeout_s=1.0) as v:
        assert v(["$\\sqrt{12}$"], answer=[SYMBOLIC_GOLD]) == [1.0]  # warm: worker started
        pid = v._pool.workers[0].proc.pid
        start = time.monotonic()
        scores = v([HANG], answer=[SYMBOLIC_GOLD])
        elapsed = time.monotonic() - start
        assert list(scores) == [None] and scores.reasons == [Skip.TIMEOUT]
        assert 1.0 <= elapsed < 2.0  # cut at the 1 s deadline (+ kill, respawn), not after the ≥ 8 s hang
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the hung worker was killed and reaped
        # The replacement worker judges the rest; a hang in the middle of a batch costs only itself.
        scores = v(["$\\sqrt{12}$", HANG, "\\sqrt{12}"], answer=[SYMBOLIC_GOLD] * 3)
        assert list(scores) == [1.0, None, 1.0]
        assert scores.reasons == [None, Skip.TIMEOUT, None]
        assert v.counters["timeouts"] == 2 and v.counters["restarts"] == 2


def test_dead_worker_is_an_error_not_a_wrong_answer():
    with MathVerifier(timeout_s=20.0) as v:
        v(["0.5"], answer=["1/2"])  # warm
        worker = v._pool.workers[0]
        killer = threading.Timer(0.5, worker.proc.kill)  # dies while stuck on HANG
        killer.start()
        scores = v([HANG], answer=[SYMBOLIC_GOLD])
        killer.join()
        assert list(scores) == [None] and scores.reasons == [Skip.ERROR]
        assert v(["0.5"], answer=["1/2"]) == [1.0]  # replaced, still serving


def test_works_from_a_thread_where_math_verify_alone_refuses(verifier):
    from math_verify import parse

    errors: list[Exception] = []
    results: list[list[float | None]] = []

    def direct() -> None:
        try:
            parse("$\\frac{1}{2}$", raise_on_error=True)  # its signal.alarm timeout needs the main thread
        except ValueError as exc:
            errors.append(exc)

    def ours() -> None:
        results.append(list(verifier(["\\frac{1}{2}"], answer=["0.5"])))

    for target in (direct, ours):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join(30)
    assert len(errors) == 1 and "thread" in str(errors[0])
    assert results == [[1.0]]


def test_bad_input_names_the_column():
    v = MathVerifier()
    with pytest.raises(VerifierInputError, match="column 'answer' has 1 entries for 2 completions"):
        v(["1", "2"], answer=["1"])
    with pytest.raises(VerifierInputError, match="expected str or int"):
        v(["1"], answer=[1.5])
    with pytest.raises(VerifierInputError, match="timeout_s must be > 0"):
        MathVerifier(timeout_s=0)
    assert v._pool.workers == []  # nothing was started for input that never got scored


@pytest.mark.parametrize(
    ("text", "integer", "literal"),
    [
        ("38", 38, True),
        ("-1,234", -1234, True),
        ("1,23", None, False),  # bad grouping
        ("0.75", None, True),
        ("3/4", None, True),
        ("\\frac{3}{4}", None, True),
        ("50\\%", None, True),
        ("12+7", None, False),
        ("x", None, False),
    ],
)
def test_literal_helpers(text, integer, literal):
    assert as_integer(text) == integer
    assert is_number_literal(text) is literal


def test_normalize_gold():
    assert normalize_gold("$\\frac{1}{2}$") == "\\frac{1}{2}"  # delimiters stripped
    assert normalize_gold(" \\boxed{38} ") == "38"  # box unwrapped
    assert normalize_gold(7) == "7"
    assert normalize_gold("   ") is None
