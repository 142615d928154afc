"""Typed records every stage consumes, and the one error type bad data raises.

A record is what one validated row of a dataset becomes: `SFTExample` (a chat), `PreferencePair`
(prompt + chosen + rejected, for the DPO family and reward models), `UnpairedExample` (prompt +
completion + a good/bad label, for KTO), `Ranking` (prompt + K ≥ 2 responses, best first) and
`Problem` (a prompt with a reference answer and/or tests, for verifiers in RLVR and evals).

Columns a record does not name (a difficulty `level` on an SFT row, gold fields of a synthetic world,
a dataset's `id`) are kept verbatim in the record's `meta` dict so a later stage can use them.
`origin` says where the record came from (`path:line` for a file, `name[i]` for an HF dataset) so
errors raised long after reading — a prompt longer than the context, say — still name the record; it
takes no part in equality.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

# The record kinds a reader can produce; the names are also the `kind` argument of the readers.
KINDS: tuple[str, ...] = ("sft", "preference", "unpaired", "ranking", "problem")


class DataError(ValueError):
    """Bad input data. The message is one line: where (file:line or dataset[row]), which field,
    what was expected and what was found. `where`, `field` and `expected` are also attributes."""

    def __init__(self, where: str, message: str, *, field: str | None = None, expected: str | None = None):
        self.where = where
        self.field = field
        self.expected = expected
        super().__init__(f"{where}: {message}" if where else message)


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        """The `{"role", "content"}` form chat templates take."""
        return {"role": self.role, "content": self.content}


Prompt = list[Message] | str


def prompt_messages(prompt: Prompt) -> list[Message]:
    """A prompt as chat messages: a bare string is one user turn."""
    return [Message("user", prompt)] if isinstance(prompt, str) else list(prompt)


@dataclass(frozen=True)
class SFTExample:
    """One chat to imitate; the loss falls on every assistant turn (see `encode_sft`)."""

    messages: list[Message]
    meta: dict[str, Any] = field(default_factory=dict)
    origin: str = field(default="", compare=False)


@dataclass(frozen=True)
class PreferencePair:
    """`chosen` is preferred over `rejected` as the assistant's reply to `prompt`."""

    prompt: Prompt
    chosen: str
    rejected: str
    meta: dict[str, Any] = field(default_factory=dict)
    origin: str = field(default="", compare=False)


@dataclass(frozen=True)
class UnpairedExample:
    """One reply with a binary verdict (`label=True`: desirable), for KTO."""

    prompt: Prompt
    completion: str
    label: bool
    meta: dict[str, Any] = field(default_factory=dict)
    origin: str = field(default="", compare=False)


@dataclass(frozen=True)
class Ranking:
    """K ≥ 2 distinct replies to `prompt`, best first."""

    prompt: Prompt
    responses: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    origin: str = field(default="", compare=False)


@dataclass(frozen=True)
class Problem:
    """A prompt a verifier can check: a reference `answer`, `tests` (e.g. for code), or both.
    `level` names a difficulty bucket so evals can report per level."""

    prompt: Prompt
    answer: str | None = None
    tests: list[Any] | None = None
    level: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    origin: str = field(default="", compare=False)


Record = SFTExample | PreferencePair | UnpairedExample | Ranking | Problem
