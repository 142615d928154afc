"""Length and format filters: drop records whose responses (or prompt) are too short, too long, or malformed.

**Length** — every response of a record (every assistant turn, `chosen` and `rejected`, a ranking's
every response) must have between `min_len` and `max_len` units, counted in `"chars"` or `"words"`
(`words()` of text.py); `part="prompt"` bounds the prompt side instead (its pieces joined). A record
with no response (a `Problem`) passes a response bound. Too short and too long are separate reasons.

**Format** — checks for text a model should never be trained to write, each its own reason:
- a chat-template control token leaked into the text (`FORBIDDEN_TOKENS`: ChatML, Llama 3, Gemma
  markers, `<|endoftext|>`) — usually a decode with special tokens kept, or a template bug;
- U+FFFD, the replacement character — bytes that did not decode (a multi-byte character cut in two);
- an unbalanced `<think>` … `</think>` (a reasoning block opened and never closed, or the reverse);
- with `require=`, a response that does not match the regular expression (`re.search`, DOTALL).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import Enum

from posttrain.data.gates.report import GateResult, Removed, make_report
from posttrain.data.gates.text import Part, record_parts, snippet, where, words
from posttrain.data.records import Record

FORBIDDEN_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|endoftext|>",                          # ChatML / GPT-2 family
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",  # Llama 3
    "<start_of_turn>", "<end_of_turn>",                                     # Gemma
)


class LengthUnit(str, Enum):
    CHARS = "chars"
    WORDS = "words"


def _size(text: str, unit: LengthUnit) -> int:
    return len(text) if unit is LengthUnit.CHARS else len(words(text))


def length_filter(records: Sequence[Record], *, min_len: int = 1, max_len: int | None = None,
                  unit: LengthUnit | str = LengthUnit.CHARS, part: Part | str = Part.RESPONSE) -> GateResult:
    """Keep records whose every response (or whose prompt, `part="prompt"`) has min_len…max_len units."""
    unit, part = LengthUnit(unit), Part(part)
    if part is Part.ALL:
        raise ValueError("length_filter: part must be 'response' or 'prompt'")
    if min_len < 0 or (max_len is not None and max_len < min_len):
        raise ValueError(f"length_filter: min_len={min_len}, max_len={max_len}; expected 0 ≤ min_len ≤ max_len")
    kept, removed = [], []
    for i, r in enumerate(records):
        prompt, responses = record_parts(r)
        texts = responses if part is Part.RESPONSE else ["\n".join(prompt)]
        sizes = [_size(t, unit) for t in texts]
        short = [s for s in sizes if s < min_len]
        long = [s for s in sizes if max_len is not None and s > max_len]
        if short:
            removed.append(Removed(where(r, i), f"{part.value} too short",
                                   f"{min(short)} {unit.value} < {min_len}", snippet(" | ".join(texts))))
        elif long:
            removed.append(Removed(where(r, i), f"{part.value} too long",
                                   f"{max(long)} {unit.value} > {max_len}", snippet(" | ".join(texts))))
        else:
            kept.append(r)
    return GateResult(kept, make_report("length", len(records), len(kept), removed))


def format_problem(text: str, *, require: re.Pattern[str] | None = None,
                   forbidden: Sequence[str] = FORBIDDEN_TOKENS) -> tuple[str, str] | None:
    """(reason, detail) of the first format problem of one response text, or None when it is clean."""
    leaked = [t for t in forbidden if t in text]
    if leaked:
        return "leaked control token", f"contains {leaked[0]}"
    if "\ufffd" in text:
        return "undecodable bytes", "contains U+FFFD"
    opened, closed = text.count("<think>"), text.count("</think>")
    if opened != closed:
        return "unbalanced <think>", f"{opened} <think>, {closed} </think>"
    if require is not None and not require.search(text):
        return "required format missing", f"no match for {require.pattern!r}"
    return None


def format_filter(records: Sequence[Record], *, require: str | re.Pattern[str] | None = None,
                  forbidden: Sequence[str] = FORBIDDEN_TOKENS) -> GateResult:
    """Keep records none of whose responses has a format problem (`format_problem`)."""
    pattern = re.compile(require, re.S) if isinstance(require, str) else require
    kept, removed = [], []
    for i, r in enumerate(records):
        _, responses = record_parts(r)
        problem = next((p for t in responses if (p := format_problem(t, require=pattern, forbidden=forbidden))), None)
        if problem is None:
            kept.append(r)
        else:
            removed.append(Removed(where(r, i), problem[0], problem[1], snippet(" | ".join(responses))))
    return GateResult(kept, make_report("format", len(records), len(kept), removed))
