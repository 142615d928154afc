"""The verifier contract, the verifier registry, and the weighted combination of several verifiers.

A verifier is a batched plain function ``(completions, **columns) -> list[float | None]``: one
score per completion, where the columns are per-completion lists (``answer=[...]``,
``lengths=[...]``) and ``None`` means *cannot judge* — the item is skipped and counted, never
silently turned into 0 or 1. A verifier may return a :class:`Scores` (a ``list`` subclass) to say
*why* each ``None`` is ``None`` (unjudgeable input, timeout, error); :func:`combine` reads it.

Reference: the weighted sum of rule-based rewards follows DeepSeek-R1 (DeepSeek-AI 2025, §2.2.2:
accuracy reward + format reward) and DAPO (Yu et al. 2025, §3.4: accuracy reward + soft overlong
punishment, eq. 13, simply added).

Departures:
1. An item whose value is ``None`` for any verifier with a non-zero weight gets a ``None`` total
   (the stage drops it and counts it) instead of summing the verifiers that did judge it: a
   format-only reward on a completion whose accuracy timed out would rank it against its group
   on a different scale. Weight-0 verifiers are computed and logged but never veto the total.
2. Verifier failures are counted apart from wrong answers: an exception raised by a verifier
   makes all of its items ``None`` with reason ``error`` (the message is kept in the stats). A
   ``ValueError`` or ``TypeError`` (:class:`VerifierInputError` included) is re-raised instead:
   by the contract a verifier never raises on a completion's *content*, so those mean bad or
   missing columns or parameters — a configuration mistake that must stop the run, not be
   counted every step.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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


# --------------------------------------------------------------------------- registry


class VerifierName(str, Enum):
    """Names a recipe can use for verifiers (``rewards: [{name: math, weight: 1.0}, ...]``)."""

    MATH = "math"  # math-verify answer checking, in killable worker processes
    FORMAT = "format"  # R1 <think>…</think> + exactly one answer over the whole completion
    OVERLONG = "overlong"  # DAPO soft overlong punishment (eq. 13)
    LENGTH = "length"  # plain linear length penalty
    CODE = "code"  # unit tests in the sandbox (posttrain.rewards.code)


# Builders import their module on call: keeps ``import posttrain.rewards`` light and acyclic.
def _build_math(
    *, timeout_s: float = 3.0, workers: int = 1, literal_numbers: bool = True, memory_limit_mb: int = 4096
) -> Verifier:
    from posttrain.rewards.math_verifier import MathVerifier

    return MathVerifier(
        timeout_s=timeout_s, workers=workers, literal_numbers=literal_numbers, memory_limit_mb=memory_limit_mb
    )


def _build_format(*, think: str = "required") -> Verifier:
    from posttrain.rewards.format import ThinkMode, format_reward

    return functools.partial(format_reward, think=ThinkMode.parse(think))


def _build_overlong(*, max_len: int, cache: int, count: str = "tokens") -> Verifier:
    from posttrain.rewards.length import (
        LengthUnit,
        check_overlong_params,
        overlong_penalty,
    )

    unit = LengthUnit.parse(count)
    check_overlong_params(max_len=max_len, cache=cache)
    return functools.partial(overlong_penalty, max_len=max_len, cache=cache, count=unit)


def _build_length(*, max_len: int, count: str = "tokens") -> Verifier:
    from posttrain.rewards.length import LengthUnit, check_length_params, length_penalty

    unit = LengthUnit.parse(count)
    check_length_params(max_len=max_len)
    return functools.partial(length_penalty, max_len=max_len, count=unit)


class _SandboxFailuresAreErrors:
    """Wraps ``posttrain.rewards.code.CodeVerifier``, whose only ``None`` is "the sandbox failed"."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __call__(self, completions: list[str], /, **columns: Any) -> Scores:
        values = self.inner(completions, **columns)
        return Scores(values, [Skip.ERROR if v is None else None for v in values])

    def close(self) -> None:
        self.inner.close()


def _build_code(
    *,
    backend: str = "bubblewrap",
    limits: dict[str, Any] | None = None,
    concurrency: int | None = None,
    partial_credit: bool = False,
) -> Verifier:
    try:
        from posttrain.rewards.code import CodeVerifier
        from posttrain.sandbox import Limits
    except ImportError as exc:
        raise VerifierInputError(
            f"verifier 'code' needs posttrain.rewards.code, which failed to import: {exc}"
        ) from exc
    return _SandboxFailuresAreErrors(
        CodeVerifier(
            backend=backend,
            limits=None if limits is None else Limits(**limits),
            concurrency=concurrency,
            partial_credit=partial_credit,
        )
    )


_BUILDERS: dict[VerifierName, Callable[..., Verifier]] = {
    VerifierName.MATH: _build_math,
    VerifierName.FORMAT: _build_format,
    VerifierName.OVERLONG: _build_overlong,
    VerifierName.LENGTH: _build_length,
    VerifierName.CODE: _build_code,
}


def build_verifier(name: str, **params: Any) -> Verifier:
    """Build the named verifier with its recipe parameters; unknown names/parameters are errors."""
    try:
        key = VerifierName(name)
    except ValueError:
        known = ", ".join(v.value for v in VerifierName)
        raise VerifierInputError(f"unknown verifier {name!r}; expected one of: {known}") from None
    builder = _BUILDERS[key]
    signature = inspect.signature(builder)
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    if not accepts_any:
        allowed = list(signature.parameters)
        for param in params:
            if param not in signature.parameters:
                raise VerifierInputError(
                    f"verifier {key.value!r}: unknown parameter {param!r}; expected one of: {', '.join(allowed)}"
                )
        missing = [
            p.name
            for p in signature.parameters.values()
            if p.default is inspect.Parameter.empty and p.name not in params
        ]
        if missing:
            raise VerifierInputError(
                f"verifier {key.value!r}: missing required parameter(s): {', '.join(missing)}"
            )
    return builder(**params)


# --------------------------------------------------------------------------- combination


@dataclass(frozen=True)
class WeightedVerifier:
    name: str  # the key under which its scores and stats are reported (``reward/<name>``)
    verifier: Verifier
    weight: float = 1.0


@dataclass(frozen=True)
class VerifierStats:
    n: int  # items given
    scored: int  # items with a number
    unjudgeable: int  # None because the input allows no judgement
    timeouts: int  # None because the verifier ran past its limit (counted in ``errors`` too)
    errors: int  # None because the verifier failed (exception, dead worker, timeout)
    mean: float | None  # mean over scored items; None when nothing was scored
    first_error: str | None  # message of the exception that failed the whole batch, if one did

    @property
    def none(self) -> int:
        return self.n - self.scored


@dataclass(frozen=True)
class CombinedRewards:
    total: list[float | None]  # weighted sum per completion; None = skip this completion
    per_verifier: dict[str, list[float | None]]  # name -> that verifier's raw (unweighted) scores
    stats: dict[str, VerifierStats]

    @property
    def skipped(self) -> int:
        return sum(t is None for t in self.total)

    def metrics(self) -> dict[str, float]:
        """Flat scalars for ``metrics.jsonl``: ``reward/total``, ``reward/<name>`` and counts."""
        judged = [t for t in self.total if t is not None]
        out: dict[str, float] = {"reward/skipped": float(self.skipped)}
        if judged:
            out["reward/total"] = sum(judged) / len(judged)
        for name, stats in self.stats.items():
            if stats.mean is not None:
                out[f"reward/{name}"] = stats.mean
            out[f"reward/{name}/unjudgeable"] = float(stats.unjudgeable)
            out[f"reward/{name}/errors"] = float(stats.errors)
            out[f"reward/{name}/timeouts"] = float(stats.timeouts)
        return out


def _check_binding(name: str, verifier: Verifier, completions: list[str], columns: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(verifier)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check up front
        return
    try:
        signature.bind(completions, **columns)
    except TypeError as exc:
        raise VerifierInputError(f"verifier {name!r} cannot take columns {sorted(columns)}: {exc}") from None


def _stats(values: list[float | None], reasons: list[Skip | None], first_error: str | None) -> VerifierStats:
    scored = [v for v in values if v is not None]
    return VerifierStats(
        n=len(values),
        scored=len(scored),
        unjudgeable=sum(r is Skip.UNJUDGEABLE for r in reasons),
        timeouts=sum(r is Skip.TIMEOUT for r in reasons),
        errors=sum(r in (Skip.TIMEOUT, Skip.ERROR) for r in reasons),
        mean=sum(scored) / len(scored) if scored else None,
        first_error=first_error,
    )


def combine(verifiers: Sequence[WeightedVerifier], completions: list[str], **columns: Any) -> CombinedRewards:
    """Run every verifier on the batch and return the weighted sum, per-verifier scores and counts.

    Every verifier receives every column (verifiers take ``**_`` for the ones they do not read).
    ``total[i] = Σ_v weight_v · score_v[i]``, or ``None`` if any non-zero-weight verifier gave ``None``.
    """
    if not verifiers:
        raise VerifierInputError("combine: no verifiers given; expected at least one WeightedVerifier")
    names = [v.name for v in verifiers]
    if len(set(names)) != len(names):
        raise VerifierInputError(f"combine: verifier names must be unique, got {names}")
    check_columns("combine", completions, **columns)
    n = len(completions)
    per_verifier: dict[str, list[float | None]] = {}
    stats: dict[str, VerifierStats] = {}
    for wv in verifiers:
        if not math.isfinite(wv.weight):
            raise VerifierInputError(
                f"combine: verifier {wv.name!r} has weight {wv.weight}; expected a finite number"
            )
        _check_binding(wv.name, wv.verifier, completions, columns)
        first_error = None
        try:
            result = wv.verifier(completions, **columns)
        except (ValueError, TypeError):  # bad input / configuration: loud (VerifierInputError included)
            raise
        except Exception as exc:  # noqa: BLE001 — a verifier failure: counted, never a silent 0
            first_error = f"{type(exc).__name__}: {exc}"
            result = Scores([None] * n, [Skip.ERROR] * n)
        if len(result) != n:
            raise VerifierInputError(
                f"verifier {wv.name!r} returned {len(result)} scores for {n} completions"
            )
        values = [None if v is None else float(v) for v in result]
        reasons = result.reasons if isinstance(result, Scores) else Scores(values).reasons
        per_verifier[wv.name] = values
        stats[wv.name] = _stats(values, reasons, first_error)

    weighted = [(wv.weight, per_verifier[wv.name]) for wv in verifiers if wv.weight != 0.0]
    total: list[float | None] = []
    for i in range(n):
        terms = [(weight, values[i]) for weight, values in weighted]
        total.append(
            None if any(v is None for _, v in terms) else sum((w * v for w, v in terms if v is not None), 0.0)
        )
    return CombinedRewards(total=total, per_verifier=per_verifier, stats=stats)
