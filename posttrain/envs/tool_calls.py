"""The tool-call format, and a parser of the model's text that never raises.

A call is a JSON object between tags, in the assistant's text — the Hermes format that Qwen2.5/Qwen3
and NousResearch Hermes chat templates use (their `tools=` system prompt asks for exactly this):

    <tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>

A turn may hold several calls (run in order, each answered by its own message). Each result goes back
as one chat message of role `tool` whose content is the result's text; the chat template renders it
(ChatML: `<|im_start|>tool\n…<|im_end|>`; Qwen's template wraps it in `<tool_response>` tags inside
a user turn). Text outside the tags is the model's prose; a turn with no `<tool_call>` tag is an answer.

Everything the model can get wrong is a `CallError` with a message for the model, never an
exception: an unclosed tag, a body that is not JSON (or too long, or nested too deep), a JSON value
that is not an object, a missing or non-string `name`, `arguments` that are not an object, more calls
than `max_calls` in one turn. Unknown tool names are the executor's to judge (`tools.run_calls`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_BODY_CHARS = 4096  # a call's JSON longer than this is refused unparsed (bounds the parser's work)
_TAG = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    message: str  # what the model is told (as a `tool` message), e.g. "error: tool call 1 is not valid JSON …"


@dataclass(frozen=True)
class ParsedTurn:
    """A turn's calls in order: each a `ToolCall` or the `CallError` that replaced it."""

    items: list[ToolCall | CallError] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.items)

    @property
    def errors(self) -> int:
        return sum(isinstance(i, CallError) for i in self.items)


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call, as the model should write it (for prompts, SFT data and tests)."""
    return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CLOSE}"


def parse_tool_calls(text: str, *, max_calls: int = 4) -> ParsedTurn:
    """Every `<tool_call>` block of `text`, parsed. Never raises (see the module docstring)."""
    items: list[ToolCall | CallError] = []
    for k, match in enumerate(_TAG.finditer(text), start=1):
        if k > max_calls:
            items.append(CallError(f"error: more than {max_calls} tool calls in one turn; the rest were not run"))
            break
        items.append(_parse_one(k, match.group(1), closed=bool(match.group(2))))
    return ParsedTurn(items)


def _parse_one(k: int, body: str, *, closed: bool) -> ToolCall | CallError:
    if not closed:
        return CallError(f"error: tool call {k} has no closing {CLOSE} tag")
    if len(body) > MAX_BODY_CHARS:
        return CallError(f"error: tool call {k} is {len(body)} characters long; the limit is {MAX_BODY_CHARS}")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: "[[[[…" nested past the parser's stack
        return CallError(f"error: tool call {k} is not valid JSON ({str(e)[:120]}); expected "
                         '{"name": "<tool>", "arguments": {...}}')
    if not isinstance(value, dict):
        return CallError(f"error: tool call {k} must be a JSON object with \"name\" and \"arguments\"")
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return CallError(f"error: tool call {k} has no \"name\" string")
    if not isinstance(arguments, dict):
        return CallError(f"error: tool call {k} ({name}): \"arguments\" must be a JSON object")
    return ToolCall(name, arguments)
