"""pass@k: the unbiased estimator of Chen et al. 2021, per-level aggregation, and standard errors.

Reference: Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2.1, eq. 1:
with n samples per problem of which c are correct,

    pass@k = E_problems[ 1 − C(n−c, k) / C(n, k) ]

computed in the numerically stable product form of the paper's Figure 3,
``1 − Π_{i=n−c+1}^{n} (1 − k/i)``, which never forms the huge binomials.

Departures:
1. The standard error reported with each mean is the standard error across problems,
   ``s / √N`` with ``s`` the sample standard deviation (ddof = 1) of the per-problem estimates.
   For pass@1 with one greedy sample per problem this is the binomial ``√(p(1−p)/(N−1))``; it
   treats problems as the sampling unit and ignores the (smaller) within-problem sampling noise,
   so for k > 1 it is an approximation. ``None`` when N < 2.
2. Results carry an optional difficulty ``level``; :func:`pass_at_k_by_level` reports every level
   (in order of first appearance) and the pool of all problems (``level=None``), shaped for the
   run directory's ``evals.jsonl``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction


def _check(n: int, c: int, k: int) -> None:
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"pass@k: n (samples per problem) must be an int >= 1, got {n!r}")
    if not (isinstance(c, int) and 0 <= c <= n):
        raise ValueError(f"pass@k: c (correct samples) must be an int in [0, n={n}], got {c!r}")
    if not (isinstance(k, int) and 1 <= k <= n):
        raise ValueError(
            f"pass@k: k must be an int in [1, n={n}] (cannot estimate pass@{k} from {n} samples)"
        )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``1 − C(n−c, k)/C(n, k)``, product form."""
    _check(n, c, k)
    if n - c < k:
        return 1.0  # every size-k subset contains a correct sample
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k_naive(n: int, c: int, k: int) -> float:
    """Reference implementation with exact binomials (slow for large n; for tests)."""
    _check(n, c, k)
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def stderr_of_mean(values: Sequence[float]) -> float | None:
    """``s / √N`` with the sample standard deviation (ddof = 1); None when N < 2."""
    count = len(values)
    if count < 2:
        return None
    mean = sum(values) / count
    variance = sum((v - mean) ** 2 for v in values) / (count - 1)
    return math.sqrt(variance / count)


@dataclass(frozen=True)
class ProblemOutcome:
    n: int  # samples drawn for the problem
    c: int  # of which correct
    level: str | None = None  # difficulty level, e.g. "1-2 digit add/sub"


@dataclass(frozen=True)
class PassAtK:
    level: str | None  # None = all problems pooled
    k: int
    value: float  # mean over problems of the unbiased per-problem estimate
    n_problems: int
    stderr: float | None

    @property
    def metric(self) -> str:
        return f"pass@{self.k}"

    def as_eval_record(self, *, stage: str, checkpoint: str, eval: str) -> dict[str, object]:
        """One ``evals.jsonl`` line (docs/run_dir.md): n is the number of problems."""
        return {
            "stage": stage,
            "checkpoint": checkpoint,
            "eval": eval,
            "level": self.level,
            "metric": self.metric,
            "value": self.value,
            "n": self.n_problems,
            "stderr": self.stderr,
        }


def _summarize(level: str | None, outcomes: Sequence[ProblemOutcome], k: int) -> PassAtK:
    for idx, o in enumerate(outcomes):
        if k > o.n:
            raise ValueError(
                f"pass@{k}: problem {idx} of level {level!r} has only n={o.n} samples; need n >= k"
            )
    per_problem = [pass_at_k(o.n, o.c, k) for o in outcomes]
    return PassAtK(
        level=level,
        k=k,
        value=sum(per_problem) / len(per_problem),
        n_problems=len(per_problem),
        stderr=stderr_of_mean(per_problem),
    )


def pass_at_k_by_level(outcomes: Iterable[ProblemOutcome], ks: Sequence[int] = (1,)) -> list[PassAtK]:
    """pass@k for each level (first-appearance order), then for all problems pooled (level None).

    When every outcome has ``level=None`` only the pooled rows are returned.
    """
    items = list(outcomes)
    if not items:
        raise ValueError("pass_at_k_by_level: no problem outcomes given")
    if not ks:
        raise ValueError("pass_at_k_by_level: no k given; expected e.g. ks=(1, 8)")
    by_level: dict[str, list[ProblemOutcome]] = {}
    for o in items:
        if o.level is not None:
            by_level.setdefault(o.level, []).append(o)
    rows: list[PassAtK] = []
    for level, group in by_level.items():
        rows.extend(_summarize(level, group, k) for k in ks)
    rows.extend(_summarize(None, items, k) for k in ks)
    return rows
