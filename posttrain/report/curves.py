"""Training curves of a stage from metrics.jsonl, downsampled so a long run's report stays small.

Downsampling keeps, per bucket of consecutive points, the lowest and the highest value (in step
order), plus the first and the last point: a loss spike or a collapse survives, which an average or
a stride would hide. Non-finite values (a NaN loss is evidence) are not plotted; their steps are
listed beside the chart instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_POINTS = 400  # per series; 2 points (min, max) per bucket

# Keys that are not curves of the stage: the phase table and the busy line are drawn elsewhere.
_SKIP_PREFIXES = ("phase/", "phase@", "telemetry/")
_SKIP_KEYS = {"stage", "step", "time"}
# Order of the small multiples: what the stage optimizes first, its optimizer's state last.
_ORDER = ("loss/", "eval/", "reward/", "gold/", "rm/", "kl", "entropy", "length", "train/")


@dataclass
class Curve:
    key: str
    steps: list[int]
    values: list[float]
    logged: int                                            # points before downsampling
    nonfinite_steps: list[int] = field(default_factory=list)

    @property
    def constant(self) -> bool:
        """Several points, all equal and finite: shown as one number instead of a flat chart."""
        return len(self.values) > 1 and not self.nonfinite_steps and min(self.values) == max(self.values)

    @property
    def downsampled(self) -> bool:
        return len(self.steps) < self.logged - len(self.nonfinite_steps)


def downsample(steps: Sequence[int], values: Sequence[float], max_points: int = MAX_POINTS
               ) -> tuple[list[int], list[float]]:
    """At most `max_points` points: the min and max of each bucket, in step order, first and last kept."""
    n = len(steps)
    if n <= max_points:
        return list(steps), list(values)
    if max_points < 4:
        raise ValueError(f"downsample: max_points={max_points}; expected ≥ 4 (first, last, one bucket's min and max)")
    buckets = (max_points - 2) // 2
    keep = {0, n - 1}
    inner = n - 2
    for b in range(buckets):
        lo = 1 + b * inner // buckets
        hi = 1 + (b + 1) * inner // buckets
        if hi <= lo:
            continue
        idx = range(lo, hi)
        keep.add(min(idx, key=values.__getitem__))
        keep.add(max(idx, key=values.__getitem__))
    order = sorted(keep)
    return [steps[i] for i in order], [values[i] for i in order]


def _rank(key: str) -> tuple[int, str]:
    for i, prefix in enumerate(_ORDER):
        if key.startswith(prefix):
            return i, key
    return len(_ORDER) - 1, key  # stage-specific keys go just before train/*


def stage_curves(metrics: Sequence[dict[str, Any]], max_points: int = MAX_POINTS) -> list[Curve]:
    """One curve per numeric key a stage logged (phase/ and telemetry/ keys excluded), ordered for display."""
    series: dict[str, tuple[list[int], list[float], list[int]]] = {}
    for m in metrics:
        step = m.get("step")
        if not isinstance(step, int):
            continue
        for key, value in m.items():
            if key in _SKIP_KEYS or key.startswith(_SKIP_PREFIXES):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            s, v, bad = series.setdefault(key, ([], [], []))
            if math.isfinite(value):
                s.append(step)
                v.append(float(value))
            else:
                bad.append(step)
    out = []
    for key in sorted(series, key=_rank):
        s, v, bad = series[key]
        ds, dv = downsample(s, v, max_points)
        out.append(Curve(key=key, steps=ds, values=dv, logged=len(s) + len(bad), nonfinite_steps=bad))
    return out
