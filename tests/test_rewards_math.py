"""Math verifier: math-verify's extraction on real answers, the golden table, the integer fast path,
the literal guard, the hard timeout, threads."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from posttrain.rewards import MathVerifier, Skip, VerifierInputError
from posttrain.rewards.math_verifier import (
    fast_integers,
    final_value,
    gold_text,
    is_number_literal,
)

GOLDEN = Path(__file__).parent / "data" / "math_golden.jsonl"

# A pred that hangs math-verify's verify() for many seconds (sympy tries to compare 10^(10^10)).
HANG = "<think>huge</think> \\boxed{10^{10^{10}}}"
SYMBOLIC_GOLD = "2\\sqrt{3}"  # not a number literal, so the literal guard lets the hang through

# (completion, gold); each line says why it scores 1.0.
POSITIVES = [
    ("12 + 7 = 19", "19"),  # SmolLM2-135M-Instruct's own answer: the last '=' is the answer
    ("The answer is 19.", "19"),  # the other one: an "answer is" span
    ("<think>12+7=19, 19*2=38</think> 38", "38"),  # the arithmetic world, R1 shape
    ("38", "38"),  # easy problem answered directly
    ("<think>5-17=-12</think> -12", "-12"),  # negative integer
    ("<think>19*2=38</think>\n\n38.", "38"),  # trailing period is punctuation
    ("<think>19*2=38</think> \\boxed{38}", "38"),  # boxed
    ("<think>19*2=38</think> The answer is $\\boxed{38}$.", "38"),  # prose + boxed, in math mode
    ("<think>sum</think> 1,234", "1234"),  # thousands separator, plain
    ("<think>sum</think> 1,234,567", "1234567"),  # two separators
    ("<think>sum</think> $1{,}234$", "1234"),  # LaTeX thousands separator
    ("<think>ratio</think> \\frac{3}{4}", "3/4"),  # LaTeX fraction vs plain gold
    ("<think>ratio</think> 3/4", "\\frac{3}{4}"),  # plain fraction vs bare LaTeX gold (boxed for parsing)
    ("<think>ratio</think> 0.75", "3/4"),  # decimal vs fraction
    ("<think>ratio</think> $\\dfrac{6}{8}$", "0.75"),  # unreduced LaTeX fraction vs decimal
    ("<think>half</think> -\\frac{1}{2}", "-0.5"),  # signed fraction vs signed decimal
    ("38.0", "38"),  # decimal form of an integer (not the fast path: goes to math-verify)
    ("<think>root</think> $2\\sqrt{3}$", "\\sqrt{12}"),  # symbolic, LaTeX both sides
    ("<think>set</think> \\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # bare LaTeX set gold: read boxed
    ("\\boxed{38}", "\\boxed{38}"),  # a boxed gold is read as it is
    ("<think>assign</think> x=38", "38"),  # an x = … form states its value
    ("<think>19*2=38</think> 38 is my final answer", "38"),  # prose around it: math-verify reads 38
    ("<think>19*2=38</think> \\boxed{38} because 19*2=38", "38"),  # the box wins over what follows
    ("<think>19*2=38</think> 38<|im_end|>", "38"),  # a left-over special token is format's business
    ("The answer is 38", "38"),  # prose with an answer span, no box
    ("<think>x</think> 007", "7"),  # leading zeros: math-verify reads 7 (fast path agrees)
]

# (completion, gold); each line says why it scores 0.0.
NEGATIVES = [
    ("<think>12+7=19, 19*2=38</think> 39", "38"),  # plain wrong
    ("12 + 7 = 18", "19"),  # wrong after the '='
    ("<think>ratio</think> 0.7", "3/4"),  # wrong decimal
    ("<think>third</think> 0.333", "1/3"),  # 3 decimals is not 1/3 (math-verify rounds to 6)
    ("<think>sum</think> 12,34", "1234"),  # a decimal comma: 12.34, not 1234
    ("<think>12+7=19, 19*2=38</think>", "38"),  # missing answer
    ("<think>12+7=19, 19*2=38", "38"),  # reasoning never closed: no answer
    ("", "38"),  # empty completion
    ("<think>19*2=38</think> 38 39", "38"),  # two answers: math-verify grades the last
    ("<think>19*2=38</think> 38 or 39", "38"),  # hedged: the last is 39
    ("<think>19*2=38</think> 38\n39", "38"),  # two lines: the last is 39
    ("<think>19*2=38</think> $38$ or $39$", "38"),  # "or"-joined math: the set {38, 39} is not 38
    ("<think>a</think> 38 <think>b</think> 38", "38"),  # a second think block: no answer region
    ("<think>the answer is \\boxed{38}</think>", "38"),  # answer only inside the reasoning
    ("<think>19*2=38 so 38</think> I am not sure", "38"),  # answer only inside the reasoning
    ("<think>restate</think> 12+7", "19"),  # restating the question is not an answer (literal guard)
    ("<think>restate</think> $19 = 12+7$", "19"),  # the last '=' states an expression (literal guard)
    ("+5", "5"),  # math-verify finds no number in '+5' (no fast path for it)
    ("-007", "-7"),  # nor in '-007'
    ("٣", "3"),  # an Arabic-Indic digit is not read as 3 (the fast path is ASCII only)
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


# Every text the fast path claims, and its neighbours it must leave to math-verify.
FAST_CASES = ["38", "-12", "0", "00", "007", "-0", "-00", "39", "-38", "38.", "-38.", " 19 \n", "+5",
              "-007", "1,234", "12,34", "٣", "12345678901234567890"]


def test_integer_fast_path_agrees_with_math_verify():
    golds = ["38", "-12", "0", "0", "7", "0", "0", "38", "38", "38", "-38", "19", "5",
             "-7", "1234", "1234", "3", "12345678901234567890"]
    # 1 1 1 1 1 (leading zeros) 1 1 (-0 is 0) 0 0 (sign) 1 1 (final period) 1 (whitespace)
    # 0 (math-verify reads no number in +5 or -007) 1 (separator) 0 (decimal comma) 0 (not ASCII) 1
    expected = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0,
                0.0, 1.0, 0.0, 0.0, 1.0]
    claimed = [fast_integers(g, c) is not None for g, c in zip(golds, FAST_CASES)]
    assert claimed == [True] * 12 + [False] * 5 + [True]  # +5, -007, 1,234, 12,34, ٣ go to math-verify
    with MathVerifier(timeout_s=5.0) as fast_verifier, MathVerifier(timeout_s=5.0, integer_fast_path=False) as slow_verifier:
        fast = fast_verifier(FAST_CASES, answer=golds)
        slow = slow_verifier(FAST_CASES, answer=golds)
        # 13 integers in-process, and ٣ too (no ASCII digit for a number gold); 4 to math-verify
        assert fast_verifier.counters["in_process"] == 14 and fast_verifier.counters["pooled"] == 4
        assert slow_verifier.counters["pooled"] == len(FAST_CASES)  # every item through math-verify
    assert list(slow) == expected
    assert list(fast) == expected  # the fast path changes no verdict


def test_digit_free_answers_to_a_number_gold_are_decided_in_process():
    completions = ["I do not know", "$x$", "\\frac{a}{b}", "nineteen", "<think>19</think> many"]
    golds = ["19", "19", "1/2", "19", "19"]
    with MathVerifier(timeout_s=5.0) as fast_verifier, MathVerifier(timeout_s=5.0, integer_fast_path=False) as slow_verifier:
        fast = fast_verifier(completions, answer=golds)
        slow = slow_verifier(completions, answer=golds)
        assert fast_verifier.counters["in_process"] == 5 and fast_verifier.counters["pooled"] == 0
    assert list(fast) == list(slow) == [0.0] * 5  # the worker, asked, says the same


def test_the_two_answers_smollm2_writes_score_one(verifier):
    # issue 21: asked "Compute 12 + 7. Reply with the number only.", SmolLM2-135M-Instruct writes these
    assert verifier(["12 + 7 = 19", "The answer is 19."], answer=["19", "19"]) == [1.0, 1.0]
    assert verifier(["12 + 7 = 19", "The answer is 19."], answer=[19, 19]) == [1.0, 1.0]  # int gold column


def _golden_rows() -> list[dict]:
    return [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_golden_table_agrees_with_math_verify(verifier):
    """Our verifier against `math_verify.verify(parse(gold), parse(answer))` with math-verify's
    defaults on every row of tests/data/math_golden.jsonl; the only disagreements allowed are the
    rows marked with a `departure` (each says why), and they must disagree."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    rows = _golden_rows()
    assert len(rows) >= 60
    ours = verifier([r["answer"] for r in rows], answer=[r["gold"] for r in rows])
    reference = [float(verify(parse(r["gold"], parsing_timeout=None), parse(r["answer"], parsing_timeout=None),
                              timeout_seconds=None)) for r in rows]
    disagree = [(r["gold"], r["answer"], ref, got) for r, ref, got in zip(rows, reference, ours) if ref != got]
    departures = [(r["gold"], r["answer"]) for r in rows if "departure" in r]
    assert [(g, a) for g, a, _, _ in disagree] == departures  # exactly the listed departures, no other
    agreement = 1 - len(disagree) / len(rows)
    assert agreement >= 0.95, f"{agreement:.3f}"  # 107 / 111 = 0.964 when written
    assert all(got == 0.0 and ref == 1.0 for _, _, ref, got in disagree)  # we only ever withhold


def test_golden_table_rows_are_well_formed():
    for i, r in enumerate(_golden_rows(), start=1):
        assert set(r) <= {"category", "gold", "answer", "documented", "source", "departure", "note"}, i
        assert r["documented"] in (0, 1) and r["gold"].strip() and r["answer"].strip(), i


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
        # (a bare "\\sqrt{12}" without delimiters would be read by math-verify as the number 12)
        scores = v(["$\\sqrt{12}$", HANG, "\\boxed{\\sqrt{12}}"], answer=[SYMBOLIC_GOLD] * 3)
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
    ("text", "literal"),
    [
        ("38", True),
        ("-1,234", True),
        ("11,\\!111", True),  # what math-verify extracts from $11,\!111$
        ("1,23", False),  # bad grouping
        ("0.75", True),
        ("3/4", True),
        ("\\frac{3}{4}", True),
        ("\\cfrac{1}{3}", True),
        ("50\\%", True),
        ("12+7", False),
        ("x", False),
    ],
)
def test_is_number_literal(text, literal):
    assert is_number_literal(text) is literal


def test_final_value():
    assert final_value("k = \\frac{1}{3}") == "\\frac{1}{3}"
    assert final_value("12+7=19") == "19"
    assert final_value("x\\approx11") == "11"
    assert final_value("( \\frac{1}{3} )") == "\\frac{1}{3}"  # \left( … \right) normalized by math-verify
    assert final_value("(9+1)") == "9+1"  # still an expression: the guard rejects it


def test_gold_text():
    assert gold_text("$\\frac{1}{2}$") == "$\\frac{1}{2}$"  # delimited: math-verify reads it as it is
    assert gold_text(" \\boxed{38} ") == "\\boxed{38}"
    assert gold_text("2\\sqrt{3}") == "\\boxed{2\\sqrt{3}}"  # bare LaTeX: read as it is, it would be 2
    assert gold_text("1,22") == "1,22"  # plain number: boxed it would be the set {1, 22}
    assert gold_text(7) == "7"
    assert gold_text("   ") is None
