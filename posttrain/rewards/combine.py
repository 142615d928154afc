"""The weighted combination of several verifiers, with per-verifier counts of what each could not judge.

The verifiers obey the contract of ``base.py`` (scores or ``None`` = cannot judge, with a
:class:`~posttrain.rewards.base.Scores` reason); the registry that builds them by name is
``registry.py``.

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

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.rewards.base import Scores, Skip, Verifier, VerifierInputError, check_columns


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
