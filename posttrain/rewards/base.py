"""The verifier contract: what a verifier is, what it returns, and how it says it cannot judge.

A verifier is a batched plain function ``(completions, **columns) -> list[float | None]``: one
score per completion, where the columns are per-completion lists (``answer=[...]``,
``lengths=[...]``) and ``None`` means *cannot judge* — the item is skipped and counted, never
silently turned into 0 or 1. A verifier may return a :class:`Scores` (a ``list`` subclass) to say
*why* each ``None`` is ``None`` (unjudgeable input, timeout, error); ``combine.combine`` reads it.
Bad columns or parameters are a :class:`VerifierInputError` (a configuration error, never counted).

Every verifier module imports this one; this one imports none of them (the registry that names
them is ``registry.py``, the weighted sum ``combine.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any, Protocol


class VerifierInputError(ValueError):
    """Bad input to a verifier (missing or mis-sized column, bad parameter): a configuration error."""


class Skip(str, Enum):
    """Why a verifier returned ``None`` for an item."""

    UNJUDGEABLE = "unjudgeable"  # the input does not allow a judgement (e.g. missing gold answer)
    TIMEOUT = "timeout"  # the verifier ran past its time limit on this item (a verifier failure)
    ERROR = "error"  # the verifier raised or its worker died on this item (a verifier failure)


class Scores(list):  # list[float | None]
    """A verifier's per-completion scores plus, for each ``None``, the reason it is ``None``.

    ``reasons[i]`` is ``None`` exactly when ``self[i]`` is a number. A plain ``list`` is an equally
    valid verifier result; its ``None`` items are counted as ``Skip.UNJUDGEABLE``.
    """

    reasons: list[Skip | None]

    def __init__(self, values: Iterable[float | None], reasons: Iterable[Skip | None] | None = None):
        super().__init__(values)
        given = [None] * len(self) if reasons is None else list(reasons)
        if len(given) != len(self):
            raise ValueError(f"Scores: {len(given)} reasons for {len(self)} values; expected one per value")
        self.reasons = [
            None if value is not None else (reason if reason is not None else Skip.UNJUDGEABLE)
            for value, reason in zip(self, given)
        ]


class Verifier(Protocol):
    def __call__(self, completions: list[str], /, **columns: Any) -> list[float | None]: ...


def check_columns(verifier: str, completions: Sequence[str], **columns: Sequence[Any] | None) -> None:
    """Raise :class:`VerifierInputError` unless every given column has one entry per completion."""
    if isinstance(completions, str):
        raise VerifierInputError(f"{verifier}: completions must be a list of strings, got one str")
    for i, completion in enumerate(completions):
        if not isinstance(completion, str):
            raise VerifierInputError(
                f"{verifier}: completions[{i}] is a {type(completion).__name__}; expected str (decoded text)"
            )
    for name, values in columns.items():
        if values is None:
            continue
        if isinstance(values, str) or not hasattr(values, "__len__"):
            raise VerifierInputError(
                f"{verifier}: column {name!r} must be a list with one entry per completion, "
                f"got {type(values).__name__}"
            )
        if len(values) != len(completions):
            raise VerifierInputError(
                f"{verifier}: column {name!r} has {len(values)} entries for {len(completions)} "
                f"completions; expected one per completion"
            )
