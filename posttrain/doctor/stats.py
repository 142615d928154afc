"""Robust statistics over one logged curve: levels, noise and slopes that one outlier cannot move.

Every rule judges a curve against itself: its own start (median of the first points), its own noise
(the spread of point-to-point differences, by the median absolute deviation), and a Theil–Sen slope
over a window (the median of pairwise slopes: robust to 29% outliers; Sen 1968). A change counts
when it exceeds both a relative threshold and a multiple of that noise, over at least `MIN_POINTS`
logged points.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MIN_POINTS = 5        # fewest logged points a trend rule judges
MAD_TO_SIGMA = 1.4826  # σ of a normal distribution = 1.4826 × its MAD


def finite(steps: Sequence[int], values: Sequence[float]) -> tuple[list[int], list[float]]:
    pairs = [(s, v) for s, v in zip(steps, values) if v is not None and math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return float("nan")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def mad_sigma(xs: Sequence[float]) -> float:
    """Robust σ of `xs` (1.4826 × median absolute deviation)."""
    m = median(xs)
    return MAD_TO_SIGMA * median([abs(x - m) for x in xs])


def noise(values: Sequence[float]) -> float:
    """Point-to-point noise of a curve: robust σ of its second differences / √6.

    For x_i = trend + ε_i, x_{i+1} − 2x_i + x_{i−1} = ε_{i+1} − 2ε_i + ε_{i−1} (+ the trend's curvature)
    has σ·√6: a linear trend cancels exactly, so a steadily falling loss does not read as noise (first
    differences would). Under 4 points: first differences / √2."""
    if len(values) < 3:
        return 0.0
    if len(values) < 4:
        return mad_sigma([b - a for a, b in zip(values, values[1:])]) / math.sqrt(2)
    d2 = [values[i + 1] - 2 * values[i] + values[i - 1] for i in range(1, len(values) - 1)]
    return mad_sigma(d2) / math.sqrt(6)


def theil_sen(steps: Sequence[float], values: Sequence[float]) -> float:
    """Median of the pairwise slopes (Sen 1968). O(n²): callers pass a window (≤ ~60 points)."""
    slopes = [(values[j] - values[i]) / (steps[j] - steps[i])
              for i in range(len(steps)) for j in range(i + 1, len(steps)) if steps[j] != steps[i]]
    return median(slopes) if slopes else 0.0


def start_level(values: Sequence[float], k: int = 3) -> float:
    """The stage's own start: the median of its first `k` logged points."""
    return median(values[:k])


def end_level(values: Sequence[float], k: int = 3) -> float:
    return median(values[-k:])


def rolling_median(values: Sequence[float], k: int = 3) -> list[float]:
    """Trailing median over `k` points (the first points use what they have)."""
    return [median(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def first_persistent(steps: Sequence[int], flags: Sequence[bool]) -> int | None:
    """The step from which `flags` holds to the end (the signature started there and did not go away)."""
    first = None
    for s, f in zip(steps, flags):
        if f and first is None:
            first = s
        elif not f:
            first = None
    return first


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares y = c0 + c1·x; returns (c0, c1, R²)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    c1 = sxy / sxx if sxx > 0 else 0.0
    c0 = my - c1 * mx
    r2 = (sxy * sxy) / (sxx * syy) if sxx > 0 and syy > 0 else 0.0
    return c0, c1, r2
