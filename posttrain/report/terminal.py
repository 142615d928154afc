"""The terminal summary printed at the end of every run: stages, time, phase shares, verdicts, evals."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from posttrain.report._format import duration, pct
from posttrain.report.charts import eval_row_label
from posttrain.report.run_data import load_run
from posttrain.report.summaries import eval_table, rl_iterations, summarize

_STYLE = {"compute": "green", "memory": "yellow", "overhead": "red", "unknown": "dim", "rl": "magenta"}


def summary_renderable(run_dir: str | Path) -> RenderableType:
    """A rich renderable of the run: one row per stage, the RL cycle gap, and the evals across checkpoints."""
    run = load_run(run_dir)
    summaries = summarize(run)
    stages = Table(title="Stages (phases measured on the roofline)", title_justify="left")
    for col, just in (("stage", "left"), ("kind", "left"), ("steps", "right"), ("time", "right"),
                      ("phase shares", "left"), ("measured character", "left"), ("% compute roof", "right"),
                      ("busy", "right")):
        stages.add_column(col, justify=just)  # type: ignore[arg-type]
    for s in summaries:
        shares = " · ".join(f"{r.name} {pct(r.share)} [{_STYLE.get(r.bound, 'dim')}]{r.bound}[/]"
                            for r in s.phases if r.share >= 0.005) or "—"
        g = s.gap
        stages.add_row(s.info.name, s.info.kind, f"{s.steps_seen:,}", duration(s.wall_seconds), shares,
                       f"[{_STYLE.get(s.character.kind, 'dim')}]{s.character.tag}[/]",
                       pct(g.utilization, 1) if g else "—", pct(g.busy) if g else "—")
    parts: list[RenderableType] = [stages]

    for it in rl_iterations(run):
        p = it.pooled
        roof = "compute roof unknown (no peaks)" if p.utilization is None else f"{pct(p.utilization, 2)} of the compute roof"
        line = (f"{it.stage} cycle: rollout:update {p.rollout_update_ratio:.2f}:1 measured over {it.pooled_steps} steps — "
                f"{roof}, busy line {pct(p.busy)}")
        proj = [pr for pr in p.projections if pr.ratio in (1.0, 5.0, 20.0) and pr.utilization is not None]
        if proj:
            line += "; projected at " + ", ".join(f"{pr.ratio:g}:1 → {pct(pr.utilization, 2)}" for pr in proj)
        parts.append(Text(line))

    table = eval_table(run)
    if table.columns:
        ev = Table(title="Evals across the pipeline", title_justify="left")
        ev.add_column("eval")
        for c in table.columns:
            ev.add_column(c, justify="right")
        for row in table.rows:
            cells = []
            for c in table.columns:
                cell = table.cell(c, row)
                ok = cell is not None and cell.value is not None and math.isfinite(cell.value)
                cells.append(f"{100 * cell.value:.1f}%" if ok and cell else "")
            ev.add_row(eval_row_label(row), *cells)
        parts.append(ev)
    if run.doctor is not None:
        findings = run.doctor if isinstance(run.doctor, list) else (run.doctor or {}).get("findings", [])
        parts.append(Text(f"doctor: {len(findings) if isinstance(findings, list) else '?'} finding(s) — see report.html"))
    return Group(*parts)
