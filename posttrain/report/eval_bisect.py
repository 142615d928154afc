"""Bisect the evals of a run: per (eval, level, metric), its value on every checkpoint in pipeline order
(base, each stage, each round's copy `r<k>.<name>`), each move between consecutive checkpoints marked
when it is beyond two standard errors, and the first checkpoint where the number dropped.

The rule (one source of truth for `posttrain bisect`, the report's bisect table and its Δ colours):

    d = v_now − v_before between a checkpoint and the previous checkpoint that has the same row
    (a checkpoint without that row is skipped, not a break);
    se_d = sqrt(se_before² + se_now²) — the standard error of a difference of two independent
    estimates (the two checkpoints' evals score different samples' answers, so their errors add in
    quadrature);
    the move is marked "up" when d > 2·se_d and "down" when d < −2·se_d (strictly beyond); |d| ≤ 2·se_d
    is "flat".

Departures / limits:
1. A row without a standard error (null, absent or NaN — e.g. a metric whose rows carry no stderr) makes
   every move touching it unknown: shown, never marked. A recorded stderr of 0 is known (a 0% or 100%
   binomial estimate) and does take part.
2. The two estimates are treated as independent even when both checkpoints were evaluated on the same
   held-out problems (a paired test would be tighter); two standard errors is therefore conservative
   for a real change; a flat row is still marked by chance up to ~5% of the time (two-sided 2σ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from posttrain.report.run_data import RunData
from posttrain.report.summaries import EvalCell, EvalTable, eval_table

Row = tuple[str, str | None, str]  # (eval, level, metric)
Z = 2.0  # standard errors a move must exceed to be marked


@dataclass(frozen=True)
class Move:
    """One change between consecutive checkpoints holding the row."""

    before: str          # checkpoint (stage) the change is from
    after: str           # checkpoint it is to
    delta: float         # after − before, as a fraction (0.1 = 10 points)
    se: float | None     # standard error of the difference; None: a side has no stderr (unknown)
    verdict: str         # up | down | flat | unknown


@dataclass(frozen=True)
class EvalTrack:
    """One (eval, level, metric) across the pipeline."""

    row: Row
    values: dict[str, float | None]   # checkpoint → value, in pipeline order, checkpoints with this row only
    moves: list[Move]
    first_drop: str | None            # the first checkpoint whose move is "down"; None if it never dropped

    @property
    def marked(self) -> list[Move]:
        return [m for m in self.moves if m.verdict in ("up", "down")]


def _finite(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def move(before: EvalCell, after: EvalCell, *, from_: str = "", to: str = "") -> Move | None:
    """The move from `before` to `after` (the rule in the module docstring); None when a value is missing."""
    v0, v1 = _finite(before.value), _finite(after.value)
    if v0 is None or v1 is None:
        return None
    d = v1 - v0
    s0, s1 = _finite(before.stderr), _finite(after.stderr)
    if s0 is None or s1 is None:
        return Move(from_, to, d, None, "unknown")
    se = math.hypot(s0, s1)
    verdict = "up" if d > Z * se else "down" if d < -Z * se else "flat"
    return Move(from_, to, d, se, verdict)


def bisect_table(table: EvalTable) -> list[EvalTrack]:
    """Every row of the report's eval table (`eval_table`: columns in pipeline order) as an EvalTrack."""
    out = []
    for row in table.rows:
        values: dict[str, float | None] = {}
        moves: list[Move] = []
        prev: tuple[str, EvalCell] | None = None
        for col in table.columns:
            cell = table.cell(col, row)
            if cell is None:
                continue
            values[col] = _finite(cell.value)
            if values[col] is None:
                continue  # a checkpoint without a number: compare the next one with the last that had one
            if prev is not None and (m := move(prev[1], cell, from_=prev[0], to=col)) is not None:
                moves.append(m)
            prev = (col, cell)
        first = next((m.after for m in moves if m.verdict == "down"), None)
        out.append(EvalTrack(row=row, values=values, moves=moves, first_drop=first))
    return out


def bisect_run(run: RunData) -> list[EvalTrack]:
    """The EvalTracks of a loaded run (`load_run`); empty when it recorded no evals."""
    return bisect_table(eval_table(run))
