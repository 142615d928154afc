"""R1-style format verifier, and the answer-span grammar every answer-checking verifier shares.

Reference: DeepSeek-AI 2025, "DeepSeek-R1", §2.2.2 (format reward): the model must put its
reasoning between ``<think>`` and ``</think>``; the answer follows. The grammar here, matched over
the *whole* completion (surrounding whitespace ignored)::

    completion := "<think>" reasoning "</think>" answer_span      (ThinkMode.REQUIRED)
                | "<think>" reasoning "</think>" answer_span | answer_span   (ThinkMode.OPTIONAL)
    reasoning   := any text without "<think>" / "</think>", not blank in REQUIRED mode
    answer_span := exactly one answer (see :func:`extract_answer`), nothing else

An accuracy checker reads its answer from :func:`answer_region` (what follows the reasoning), never
from inside the reasoning.

Departures (R1 does not spell its grammar out; these are our choices):
1. The answer span must hold exactly one answer. Either one ``\\boxed{…}`` (repeats of the same
   box allowed) with optional prose before it and only closing punctuation/delimiters after it, or
   a bare answer: one whitespace-free token (``38``, ``-1,234``, ``3/4``, ``\\frac{3}{4}``) or one
   math-delimited expression (``$x + 1$``, ``\\(…\\)``, ``\\[…\\]``), optionally followed by a
   period. ``38 or 39``, ``38\\n39``, ``$38$ and $39$`` and ``\\boxed{38} \\boxed{39}`` are two
   answers; ``38 because …`` and ``\\boxed{38} because …`` have trailing junk; prose without a box
   (``The answer is 38``) has no declared answer. All of these fail.
2. A second ``<think>`` block, or a tag left in the answer span, is junk; so is a left-over special
   token (``38<|im_end|>``): decode completions with ``skip_special_tokens=True``.
3. ``ThinkMode.OPTIONAL`` accepts a bare answer span, for easy problems answered directly.
4. :func:`answer_region` (where the accuracy checkers look for the answer) is more lenient about
   the *reasoning* than the format check: it takes whatever follows the first ``</think>`` even
   without an opening tag (chat templates that open ``<think>`` in the prompt), so that format and
   accuracy stay separate rewards. The `math` checker extracts the answer from that region the way
   math-verify does (lenient: the last answer counts); the one-answer rule lives here only.
   :func:`final_answer` is this grammar applied to that region: where the format check passes,
   both return the same answer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import Enum
from typing import Any

from posttrain.rewards.base import VerifierInputError, check_columns

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BOX_START = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# What may follow the last box: whitespace, a period, closing math delimiters.
_BOX_TAIL = re.compile(r"(?:\s|\.|\$|\\\]|\\\))*")
# A tag or special token: <think>, </answer>, <|im_end|>, <eos> …
_TAG = re.compile(r"</?[A-Za-z_][\w-]*>|<\|")
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


class ThinkMode(str, Enum):
    REQUIRED = "required"  # <think>…</think> then the answer (R1)
    OPTIONAL = "optional"  # as REQUIRED, or the answer alone (easy problems answered directly)

    @classmethod
    def parse(cls, value: str | ThinkMode) -> ThinkMode:
        try:
            return cls(value)
        except ValueError:
            raise VerifierInputError(
                f"format verifier: think mode {value!r} is not one of: {', '.join(m.value for m in cls)}"
            ) from None


def answer_span(completion: str, *, think: ThinkMode = ThinkMode.REQUIRED) -> str | None:
    """The text after the think block if the completion has the R1 shape, else ``None``."""
    text = completion.strip()
    if text.startswith(THINK_OPEN):
        close = text.find(THINK_CLOSE)
        if close < 0:
            return None  # reasoning never closed: no answer span at all
        reasoning = text[len(THINK_OPEN) : close]
        if THINK_OPEN in reasoning:
            return None  # nested think block
        if think is ThinkMode.REQUIRED and not reasoning.strip():
            return None  # a required think block must hold reasoning
        span = text[close + len(THINK_CLOSE) :]
    elif think is ThinkMode.REQUIRED:
        return None
    else:
        span = text
    if THINK_OPEN in span or THINK_CLOSE in span:
        return None  # a second (or stray) think tag after the answer started
    return span.strip()


def _box_contents(span: str) -> tuple[list[str], int] | None:
    """Contents of every ``\\boxed{…}`` in ``span`` and the index after the last one; None if malformed."""
    contents: list[str] = []
    end = 0
    for match in _BOX_START.finditer(span):
        if match.start() < end:
            continue  # a box inside a box: part of the outer content
        i = match.end()
        while i < len(span) and span[i].isspace():
            i += 1
        if i >= len(span) or span[i] != "{":
            return None  # "\boxed 5" or a dangling "\boxed": not a box we can read
        depth, j = 0, i
        while j < len(span):
            ch = span[j]
            if ch == "\\":
                j += 2  # an escaped char (\{, \}) never opens or closes the box
                continue
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        if depth != 0:
            return None  # unbalanced braces
        contents.append(span[i + 1 : j])
        end = j + 1
    return contents, end


def _strip_delimiters(text: str) -> str | None:
    """``$x$`` → ``x`` when one pair of math delimiters wraps the whole text, else None."""
    for left, right in _DELIMITERS:
        if len(text) >= len(left) + len(right) + 1 and text.startswith(left) and text.endswith(right):
            inner = text[len(left) : len(text) - len(right)]
            if any(d in inner for d in ("$", "\\(", "\\)", "\\[", "\\]")):
                return None  # more than one math segment: "$38$ or $39$"
            return inner
    return None


def _squash(text: str) -> str:
    return "".join(text.split())


def extract_answer(span: str) -> str | None:
    """The single answer in an answer span, or ``None`` (no answer, two answers, junk)."""
    span = span.strip()
    if not span or _TAG.search(span):
        return None
    if any(cmd in span for cmd in _BOX_COMMANDS):
        boxes = _box_contents(span)
        if boxes is None:
            return None
        contents, end = boxes
        if not contents or len({_squash(c) for c in contents}) != 1:
            return None  # no readable box, or two different boxed answers
        if not _BOX_TAIL.fullmatch(span[end:]):
            return None  # trailing junk after the box
        answer = contents[-1].strip()
        return answer or None
    bare = span[:-1].rstrip() if span.endswith(".") else span
    inner = _strip_delimiters(bare)
    if inner is None:
        if "$" in bare or any(ch.isspace() for ch in bare):
            return None  # several tokens or several math segments: not one answer
        inner = bare
    inner = inner.strip()
    return inner or None


def answer_region(completion: str) -> str | None:
    """The text the answer must come from: after the first ``</think>`` (the whole completion when
    there is no think tag); ``None`` when ``<think>`` is never closed or a think tag follows.

    Unlike :func:`answer_span` it accepts a missing opening tag (chat templates that open
    ``<think>`` in the prompt) and asks nothing of the reasoning."""
    close = completion.find(THINK_CLOSE)
    if close >= 0:
        span = completion[close + len(THINK_CLOSE) :]
    elif THINK_OPEN in completion:
        return None
    else:
        span = completion
    if THINK_OPEN in span or THINK_CLOSE in span:
        return None
    return span


def final_answer(completion: str) -> str | None:
    """The single answer of :func:`answer_region`, by this module's strict grammar (else ``None``)."""
    region = answer_region(completion)
    return None if region is None else extract_answer(region)


def format_answer(completion: str, *, think: ThinkMode = ThinkMode.REQUIRED) -> str | None:
    """The answer of a well-formatted completion (parsed from the validated span), else ``None``."""
    span = answer_span(completion, think=think)
    return None if span is None else extract_answer(span)


def format_reward(
    completions: Sequence[str], *, think: ThinkMode = ThinkMode.REQUIRED, **_: Any
) -> list[float | None]:
    """1.0 when the whole completion has the R1 shape with exactly one answer, else 0.0. Never None."""
    check_columns("format", completions)
    mode = ThinkMode.parse(think)
    return [0.0 if format_answer(c, think=mode) is None else 1.0 for c in completions]
