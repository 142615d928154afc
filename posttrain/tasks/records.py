"""What an evaluation produces: one row per (eval, level, metric) of one checkpoint — the unit of
evals.jsonl, the bisect table and `posttrain eval`'s output."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EvalRecord:
    stage: str
    checkpoint: str
    eval: str
    level: str | None
    metric: str
    value: float
    n: int
    stderr: float | None


def binomial_stderr(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")
