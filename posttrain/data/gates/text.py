"""What a quality gate reads from a record: its prompt text, its response texts, normalized words.

Every gate compares records by text, so every gate reads them the same way:
- `record_parts(record)` → `(prompt_texts, response_texts)`: the prompt side is every non-assistant
  turn (a string prompt is one user turn; an SFT chat's system/user/tool turns), the response side every
  assistant turn, `chosen` and `rejected`, an unpaired `completion`, a ranking's `responses`. A
  `Problem` has no response (its `answer` is a reference, not a reply).
- `normalize(text)`: Unicode NFKC, case-folded, runs of whitespace collapsed to one space, stripped —
  so two texts differing only in spacing or casing are the same text.
- `words(text)`: the normalized text as word tokens: runs of letters/digits, and each other
  non-space character on its own (`"12+7=19"` → `12 + 7 = 19`), so arithmetic keeps its operators.
"""

from __future__ import annotations

import re
import unicodedata
from enum import Enum

from posttrain.data.records import PreferencePair, Problem, Ranking, Record, SFTExample, UnpairedExample

_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"\w+|[^\w\s]")
_SEP = "\n\x1f\n"  # joins a record's parts: a unit separator no normalized text contains


class Part(str, Enum):
    """Which text of a record a gate reads."""

    PROMPT = "prompt"      # the non-assistant turns
    RESPONSE = "response"  # the assistant turns / chosen / rejected / completion / responses
    ALL = "all"            # both


def normalize(text: str) -> str:
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def words(text: str) -> list[str]:
    return _WORD.findall(normalize(text))


def _prompt_texts(prompt: str | list) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    return [m.content for m in prompt if m.role != "assistant"]


def record_parts(record: Record) -> tuple[list[str], list[str]]:
    """(prompt texts, response texts) of a record; see the module docstring."""
    if isinstance(record, SFTExample):
        return ([m.content for m in record.messages if m.role != "assistant"],
                [m.content for m in record.messages if m.role == "assistant"])
    if isinstance(record, PreferencePair):
        return _prompt_texts(record.prompt), [record.chosen, record.rejected]
    if isinstance(record, UnpairedExample):
        return _prompt_texts(record.prompt), [record.completion]
    if isinstance(record, Ranking):
        return _prompt_texts(record.prompt), list(record.responses)
    if isinstance(record, Problem):
        return _prompt_texts(record.prompt), []
    raise TypeError(f"not a posttrain.data record: {type(record).__name__}")


def record_text(record: Record, part: Part | str = Part.ALL) -> str:
    """The record's text for `part`, its pieces normalized and joined by a separator no piece contains
    (so `["a b", "c"]` and `["a", "b c"]` stay different records)."""
    prompt, response = record_parts(record)
    part = Part(part)
    pieces = prompt if part is Part.PROMPT else response if part is Part.RESPONSE else prompt + response
    return _SEP.join(normalize(p) for p in pieces)


def where(record: Record, index: int) -> str:
    """How a report names a record: its origin (`file:line`, `name[i]`), else its index in the input."""
    return record.origin or f"[{index}]"


def snippet(text: str, width: int = 80) -> str:
    flat = _SPACE.sub(" ", text).strip()
    return flat if len(flat) <= width else flat[: width - 1] + "…"
