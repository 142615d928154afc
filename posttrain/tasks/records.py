"""What an evaluation is asked (`EvalRequest`) and produces (`EvalRecord`: one row per (eval, level,
metric) of one checkpoint — the unit of evals.jsonl, the bisect table and `posttrain eval`'s output)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from posttrain.rollout.greedy import PhaseFn  # opens the phase an eval's generation batch is timed in

__all__ = ["EvalRecord", "EvalRequest", "PhaseFn", "binomial_stderr"]


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
    round: int | None = None  # the round of the stage that made the checkpoint (a rounds block's copy), else None


def binomial_stderr(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


@dataclass(frozen=True)
class EvalRequest:
    """What one eval of a task measures (the recipe's `evals:` entry, or `posttrain eval`'s flags).

    `levels` None: every level the task has. `per_level` None: every held-out problem. `k` empty: no
    sampled pass@k; otherwise `samples` (default max(k)) answers per problem at `temperature`."""

    levels: tuple[str, ...] | None = None
    per_level: int | None = None
    greedy: bool = True
    k: tuple[int, ...] = ()
    samples: int | None = None
    temperature: float = 1.0
    max_new_tokens: int = 48
    batch_size: int = 128
    probe: bool = True
    seed: int = 0

    @property
    def n_samples(self) -> int:
        return self.samples or (max(self.k) if self.k else 0)
