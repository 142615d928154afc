"""Length rewards: DAPO's soft overlong punishment and a plain linear length penalty.

Reference: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
§3.4, eq. 13 (soft overlong punishment), with L_max the maximum length and L_cache the
punishment interval before it::

    R_length(y) = 0                                  if |y| ≤ L_max − L_cache
                = ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
                = −1                                 if L_max < |y|

It is *added* to the accuracy reward (weight 1 in DAPO). The paper's companion trick, overlong
*filtering* (masking the loss of truncated samples), is a stage concern, not a reward.

Departures:
1. ``|y|`` comes from a ``lengths=[...]`` column of response token counts (what DAPO means) when
   ``count=LengthUnit.TOKENS`` (the default; a missing column is an error). With
   ``count=LengthUnit.CHARS`` the verifier needs no tokenizer and uses ``len(completion)`` in
   characters — then ``max_len`` and ``cache`` are in characters too (≈ 3–4 characters per token
   for English BPE; 1 per token for a character-level tokenizer).
2. The plain penalty, ``−min(|y|, max_len) / max_len`` ∈ [−1, 0], is not from DAPO: it is the
   simplest monotone length cost (scale it with the recipe weight). It does not depend on the
   group, unlike Kimi k1.5's length reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

from posttrain.rewards.base import VerifierInputError, check_columns


class LengthUnit(str, Enum):
    TOKENS = "tokens"  # |y| from the ``lengths`` column (response token counts)
    CHARS = "chars"  # |y| = len(completion): no tokenizer needed; limits are in characters

    @classmethod
    def parse(cls, value: str | LengthUnit) -> LengthUnit:
        try:
            return cls(value)
        except ValueError:
            raise VerifierInputError(
                f"length count {value!r} is not one of: {', '.join(u.value for u in cls)}"
            ) from None


def check_overlong_params(*, max_len: int, cache: int) -> None:
    if not (isinstance(max_len, int) and max_len > 0):
        raise VerifierInputError(f"overlong: max_len (L_max) must be a positive int, got {max_len!r}")
    if not (isinstance(cache, int) and 0 < cache <= max_len):
        raise VerifierInputError(
            f"overlong: cache (L_cache) must be an int in (0, max_len={max_len}], got {cache!r}"
        )


def check_length_params(*, max_len: int) -> None:
    if not (isinstance(max_len, int) and max_len > 0):
        raise VerifierInputError(f"length: max_len must be a positive int, got {max_len!r}")


def _lengths(
    name: str, completions: Sequence[str], lengths: Sequence[int] | None, count: LengthUnit
) -> list[int]:
    check_columns(name, completions, lengths=lengths)
    if LengthUnit.parse(count) is LengthUnit.CHARS:
        return [len(c) for c in completions]
    if lengths is None:
        raise VerifierInputError(
            f"{name}: count='tokens' needs a lengths=[...] column of response token counts; "
            f"pass it, or use count='chars' to measure characters"
        )
    for i, n in enumerate(lengths):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise VerifierInputError(f"{name}: lengths[{i}] = {n!r}; expected a non-negative int token count")
    return list(lengths)


def soft_overlong(length: int, *, max_len: int, cache: int) -> float:
    """DAPO eq. 13 for one response length."""
    threshold = max_len - cache
    if length <= threshold:
        return 0.0
    if length <= max_len:
        return (threshold - length) / cache
    return -1.0


def overlong_penalty(
    completions: Sequence[str],
    *,
    max_len: int,
    cache: int,
    count: LengthUnit = LengthUnit.TOKENS,
    lengths: Sequence[int] | None = None,
    **_: Any,
) -> list[float | None]:
    """DAPO soft overlong punishment per completion, in [−1, 0]. Never None."""
    check_overlong_params(max_len=max_len, cache=cache)
    return [
        soft_overlong(n, max_len=max_len, cache=cache)
        for n in _lengths("overlong", completions, lengths, count)
    ]


def length_penalty(
    completions: Sequence[str],
    *,
    max_len: int,
    count: LengthUnit = LengthUnit.TOKENS,
    lengths: Sequence[int] | None = None,
    **_: Any,
) -> list[float | None]:
    """Plain linear penalty ``−min(|y|, max_len) / max_len`` per completion, in [−1, 0]. Never None."""
    check_length_params(max_len=max_len)
    return [-min(n, max_len) / max_len for n in _lengths("length", completions, lengths, count)]
