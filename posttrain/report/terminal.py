"""The terminal summary printed at the end of every run: stages, time, phase shares, verdicts, memory, evals.

It fits the terminal it is printed on: at 100 columns or more one row per stage with every column; below
that (an 80-column terminal) each stage is a short stacked block, so no header or value is cut.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.table import Table
from rich.text import Text

from posttrain.report._format import duration, pct, si
from posttrain.report.charts import eval_row_label
from posttrain.report.run_data import RunData, load_run
from posttrain.report.summaries import StageSummary, eval_table, rl_iterations, summarize

_STYLE = {"compute": "green", "memory": "yellow", "overhead": "red", "unknown": "dim", "rl": "magenta"}
WIDE = 100  # columns from which the stage table is one row per stage


def _shares(s: StageSummary) -> str:
    return " · ".join(f"{r.name} {pct(r.share)} [{_STYLE.get(r.bound, 'dim')}]{r.bound}[/]"
                      for r in s.phases if r.share >= 0.005) or "—"


def _character(s: StageSummary) -> str:
    text = f"[{_STYLE.get(s.character.kind, 'dim')}]{s.character.tag}[/]"
    if s.eval_share >= 0.005:
        text += f" [dim](+ eval {pct(s.eval_share)} of its time)[/]"
    return text


def _wide_table(summaries: list[StageSummary]) -> Table:
    stages = Table(title="Stages (phases measured on the roofline)", title_justify="left")
    for col, just in (("stage", "left"), ("kind", "left"), ("steps", "right"), ("time", "right"),
                      ("phase shares", "left"), ("measured character", "left"), ("% compute roof", "right"),
                      ("busy", "right"), ("peak mem", "right")):
        stages.add_column(col, justify=just)  # type: ignore[arg-type]
    for s in summaries:
        g = s.gap
        stages.add_row(s.info.name, s.info.kind, f"{s.steps_seen:,}", duration(s.wall_seconds), _shares(s),
                       _character(s), pct(g.utilization, 1) if g else "—", pct(g.busy) if g else "—",
                       si(s.mem_peak, "B"))
    return stages


def _stacked(summaries: list[StageSummary]) -> Group:
    """One block per stage: name, kind, steps, time on the first line; character; roof, busy, memory; shares."""
    lines: list[RenderableType] = [Text("Stages (phases measured on the roofline)", style="italic")]
    for s in summaries:
        g = s.gap
        lines.append(Text.from_markup(f"[bold]{s.info.name}[/] ({s.info.kind}) · {s.steps_seen:,} steps · "
                                      f"{duration(s.wall_seconds)}"))
        lines.append(Text.from_markup(f"  {_character(s)}"))
        lines.append(Text.from_markup(f"  compute roof {pct(g.utilization, 1) if g else '—'} · busy "
                                      f"{pct(g.busy) if g else '—'} · peak mem {si(s.mem_peak, 'B')}"))
        lines.append(Text.from_markup(f"  {_shares(s)}"))
    return Group(*lines)


class _Stages:
    """The stage summary, laid out for the width it is rendered at."""

    def __init__(self, summaries: list[StageSummary]) -> None:
        self.summaries = summaries

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield _wide_table(self.summaries) if options.max_width >= WIDE else _stacked(self.summaries)


def revision_lines(run: RunData) -> list[Text]:
    """One warning line per revised roof, or none."""
    return [Text(f"roof revised: {r.sentence()} — every figure here is against the revised roof", style="yellow")
            for r in run.revisions]


def summary_renderable(run_dir: str | Path) -> RenderableType:
    """A rich renderable of the run: the stages, the RL cycle gap, revised roofs, and the evals across checkpoints."""
    run = load_run(run_dir)
    summaries = summarize(run)
    parts: list[RenderableType] = [_Stages(summaries)]

    its = rl_iterations(run)
    for it in its:
        p = it.pooled
        roof = "compute roof unknown (no peaks)" if p.utilization is None else f"{pct(p.utilization, 2)} of the compute roof"
        line = (f"{it.stage} cycle: rollout:update {p.rollout_update_ratio:.2f}:1 measured over {it.pooled_steps} steps — "
                f"{roof}, busy line {pct(p.busy)}")
        proj = [pr for pr in p.projections if pr.ratio in (1.0, 5.0, 20.0) and pr.utilization is not None]
        if proj:
            line += "; projected at " + ", ".join(f"{pr.ratio:g}:1 → {pct(pr.utilization, 2)}" for pr in proj)
        parts.append(Text(line))
    if not its:
        parts.append(Text("no RL stage in this run (none both generated and updated): no RL cycle to show", style="dim"))
    parts += revision_lines(run)

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
