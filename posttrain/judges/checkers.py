"""Rule checkers: a registered function that decides whether a reply complies with a principle — the
gold of Constitutional AI measurement on a world — and the rule reviser derived from each.

A checker reads a problem and a reply and returns a `Verdict`: whether the principle applies to this
reply at all (a "show your work for multi-digit problems" rule does not apply to 3 + 4), whether the
reply complies, and one sentence saying why (the rule's critique). A rule reviser makes the smallest
edit that makes a non-compliant reply comply, or None when it cannot.

The checkers read the arithmetic world's reply shape (posttrain/worlds/arithmetic.py):
`<think>7+8=15, 3+4+1=8</think> [text] 85` — column work right to left, one single-digit fact per
column, then optional text, then the final integer.

| checker            | applies                               | complies when                                   |
|--------------------|---------------------------------------|-------------------------------------------------|
| `work_shown`       | a multi-digit problem (an operand ≥ 10) | the reply has `<think>` work that parses as column steps |
| `answer_from_work` | the reply states a final integer      | that integer is the number its own work computes |
| `no_filler`        | always                                | nothing but whitespace between the work (if any) and the integer |

`work_result` reads the number a column work computes without knowing the problem: each step
`…=v` is one column, right to left; every column but the last contributes its ones digit and the last
its whole value (`7+8=15, 3+4+1=8` → "8" + "5" = 85; `13-7=6, 10-1-9=0, 9-1-8=0` → 006 = 6).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from posttrain.data.records import Problem
from posttrain.worlds.arithmetic import ANSWER_RE, Fact, column_work

_STEP = re.compile(r"^\s*\d+(?:[+\-*]\d+)+\s*=\s*(\d+)\s*$")
_THINK = re.compile(r"<think>(.*?)</think>", re.S)
_LAST_INT = re.compile(r"-?\d+(?=\D*$)")


@dataclass(frozen=True)
class Verdict:
    applies: bool  # False: the principle says nothing about this reply (counted apart, neither pass nor fail)
    ok: bool       # complies (True whenever the principle does not apply)
    reason: str    # one sentence: the rule's critique


@dataclass(frozen=True)
class Reply:
    """A world reply taken apart: `work` (the <think> text, None without one), `body` (text between the
    work and the final integer), `answer` (the final integer; None when the reply is off-format)."""

    work: str | None
    body: str
    answer: int | None


def split_reply(text: str) -> Reply:
    m = ANSWER_RE.match(text.strip())
    if m is None:
        think = _THINK.search(text)
        return Reply(think.group(1) if think else None, text, None)
    return Reply(m.group("think"), m.group("body"), int(m.group("answer")))


def work_result(work: str | None) -> int | None:
    """The number a column work computes (module docstring), or None when it is not column work."""
    if not work or not work.strip():
        return None
    values = []
    for step in work.split(","):
        m = _STEP.match(step)
        if m is None:
            return None
        values.append(int(m.group(1)))
    return int(str(values[-1]) + "".join(str(v % 10) for v in reversed(values[:-1])))


def fact_of(problem: Problem) -> Fact | None:
    """The world problem behind `problem` (its meta carries a, op, b), else None."""
    try:
        return Fact(int(problem.meta["a"]), str(problem.meta["op"]), int(problem.meta["b"]))
    except (KeyError, TypeError, ValueError):
        return None


def multi_digit(problem: Problem) -> bool:
    """An operand ≥ 10; without a world fact, a reference answer of two or more digits."""
    f = fact_of(problem)
    if f is not None:
        return max(f.a, f.b) >= 10
    return problem.answer is not None and len(str(problem.answer).lstrip("-")) >= 2


# ---- checkers ----------------------------------------------------------------------------------------
def work_shown(problem: Problem, text: str) -> Verdict:
    if not multi_digit(problem):
        return Verdict(False, True, "a single-digit problem: no work is required")
    r = split_reply(text)
    if work_result(r.work) is None:
        return Verdict(True, False, "a multi-digit problem answered without column work in <think>")
    return Verdict(True, True, "the column work is shown")


def answer_from_work(problem: Problem, text: str) -> Verdict:
    r = split_reply(text)
    if r.answer is None:
        return Verdict(False, True, "no final answer is stated")
    computed = work_result(r.work)
    if computed is None:
        return Verdict(True, False, f"the reply states {r.answer} but shows no work that computes it")
    if computed != r.answer:
        return Verdict(True, False, f"the reply states {r.answer} but its work computes {computed}")
    return Verdict(True, True, f"the stated {r.answer} is what the work computes")


def no_filler(problem: Problem, text: str) -> Verdict:
    r = split_reply(text)
    if r.answer is None:
        return Verdict(True, False, "the reply does not end in one final number")
    if r.body.strip():
        return Verdict(True, False, f"filler before the answer: {r.body.strip()!r}")
    return Verdict(True, True, "no filler")


# ---- rule revisers: the smallest edit that makes a reply comply -------------------------------------
def _join(work: str | None, body: str, answer: int | str) -> str:
    head = f"<think>{work}</think> " if work is not None else ""
    return f"{head}{body.strip() + ' ' if body.strip() else ''}{answer}"


def revise_work_shown(problem: Problem, text: str) -> str | None:
    """Writes the problem's column work into <think> (the world's own procedure: this reviser knows
    arithmetic the policy may not), keeping the rest of the reply as it was."""
    f = fact_of(problem)
    if f is None:
        return None
    rest = _THINK.sub("", text).strip()
    return f"<think>{column_work(f)}</think> {rest}".strip()


def revise_answer_from_work(problem: Problem, text: str) -> str | None:
    """States the number the reply's own work computes; without parseable work, writes the problem's
    column work and its result."""
    r = split_reply(text)
    computed = work_result(r.work)
    if computed is not None:
        return _join(r.work, r.body if r.answer is not None else "", computed)
    f = fact_of(problem)
    return None if f is None else _join(column_work(f), r.body if r.answer is not None else "", f.value)


def revise_no_filler(problem: Problem, text: str) -> str | None:
    """Drops everything between the work and the final integer (the reply's own last integer)."""
    r = split_reply(text)
    if r.answer is not None:
        return _join(r.work, "", r.answer)
    tail = _THINK.sub("", text)
    m = _LAST_INT.search(tail)
    return None if m is None else _join(r.work, "", m.group(0))


Checker = Callable[[Problem, str], Verdict]
RuleReviser = Callable[[Problem, str], "str | None"]

CHECKERS: dict[str, Checker] = {"work_shown": work_shown, "answer_from_work": answer_from_work, "no_filler": no_filler}
RULE_REVISERS: dict[str, RuleReviser] = {"work_shown": revise_work_shown, "answer_from_work": revise_answer_from_work,
                                         "no_filler": revise_no_filler}


def rule_revision(check: str, problem: Problem, text: str) -> tuple[str, str | None]:
    """(critique, revision) by the named checker's rule: a compliant reply comes back unchanged."""
    verdict = CHECKERS[check](problem, text)
    if verdict.ok:
        return f"Complies: {verdict.reason}.", text.strip()
    return f"Does not comply: {verdict.reason}.", RULE_REVISERS[check](problem, text)
