"""report.html: one self-contained page (Plotly's JS, the page's CSS and JS, and the data inlined).

Sections: 1. the pipeline (click a stage → its panel), 2. one RL iteration with the rollout:update
slider (RL stages only — those that ran generate and update; a note when the run has none), 3. the
roofline (and any roof the run revised), 4. memory over the run, 5. evals across the pipeline (the
bisect table), 6. the doctor's findings (doctor.json, when present).

The static parts are HTML written here; the page's script (assets/report.js) draws the figures from
the embedded JSON and recomputes the projection with the same formula as `posttrain.telemetry.gap`.
"""

from __future__ import annotations

import html
import json
import math
import re
import time
from importlib import resources
from pathlib import Path
from typing import Any

from posttrain.report import charts
from posttrain.report._format import duration, pct, pct100, si
from posttrain.report.curves import MAX_POINTS, stage_curves
from posttrain.report.doctor_panel import doctor_section
from posttrain.report.eval_bisect import Move, bisect_table, move
from posttrain.report.run_data import BASE, RunData, finite_or_none, load_run
from posttrain.report.summaries import (
    EVAL_PHASES,
    EvalTable,
    RLIteration,
    StageSummary,
    eval_table,
    rl_iterations,
    summarize,
)
from posttrain.telemetry.gap import ROLLOUT_PHASES, UPDATE_PHASES, gap

SLIDER_RATIOS = tuple(range(1, 21))  # the slider's stops: 1:1 … 20:1
e = html.escape


def _asset(name: str) -> str:
    return (resources.files("posttrain.report") / "assets" / name).read_text(encoding="utf-8")


def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return finite_or_none(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _chart(fig_id: str, figs: dict[str, Any], fig: dict[str, Any] | None, empty: str) -> str:
    if fig is None:
        return f'<p class="muted">{e(empty)}</p>'
    figs[fig_id] = fig
    return f'<div class="chart" id="{fig_id}" data-fig="{fig_id}"></div>'


# ---- 1. the pipeline -------------------------------------------------------------------------------------

def _share_bar(s: StageSummary, names: list[str]) -> str:
    parts = "".join(
        f'<span style="width:{100 * r.share:.3f}%;background:{charts.phase_color(r.name, names)}" '
        f'title="{e(r.name)} {pct(r.share)}"></span>' for r in s.phases if r.share > 0)
    return f'<div class="sharebar">{parts}</div>'


def _phase_table(s: StageSummary, names: list[str]) -> str:
    if not s.phases:
        return '<p class="muted">No phases recorded for this stage.</p>'
    head = ("phase", "time share", "seconds", "n", "FLOP/s", "bytes/s", "FLOP/B", "% compute roof",
            "% bandwidth roof", "% of its roof", "verdict", "busy", "peak memory")
    rows = []
    for r in s.phases:
        rows.append(
            f'<tr><td><i class="dot" style="background:{charts.phase_color(r.name, names)}"></i>{e(r.name)}</td>'
            f'<td>{pct(r.share)}</td><td>{r.seconds:.3f}</td><td>{r.occurrences}</td>'
            f'<td>{si(r.flops_per_s, "FLOP/s")}</td><td>{si(r.bytes_per_s, "B/s")}</td>'
            f'<td>{"—" if r.intensity is None else f"{r.intensity:.3g}"}</td>'
            f'<td>{pct100(r.pct_compute_roof)}</td><td>{pct100(r.pct_bandwidth_roof)}</td>'
            f'<td>{pct(r.efficiency, 1)}</td><td><span class="verdict v-{e(r.bound)}">{e(r.bound)}</span></td>'
            f'<td>{pct(r.busy)}</td><td>{si(r.mem_peak, "B")}</td></tr>')
    th = "".join(f"<th>{h}</th>" for h in head)
    return f'<table class="data num"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _stage_evals(table: EvalTable, stage: str) -> str:
    if stage not in table.columns:
        return '<p class="muted">No evals recorded for this checkpoint.</p>'
    i = table.columns.index(stage)
    prev = table.columns[i - 1] if i > 0 else None
    rows = []
    for row in table.rows:
        c = table.cell(stage, row)
        if c is None:
            continue
        delta = ""
        p = table.cell(prev, row) if prev else None
        if p is not None:
            delta = _delta(move(p, c))
        rows.append(f"<tr><td>{e(charts.eval_row_label(row))}</td><td>{_cell_value(c)}</td><td>{delta}</td></tr>")
    th = f"<th>eval</th><th>{e(stage)}</th><th>{'Δ vs ' + e(prev) if prev else ''}</th>"
    return f'<table class="data num"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _stage_panel(i: int, s: StageSummary, run: RunData, table: EvalTable, figs: dict[str, Any], names: list[str]) -> str:
    curves = stage_curves(run.stage_metrics(s.info.name))
    varying = [c for c in curves if not c.constant]
    fig = charts.curves_figure(varying, cols=3 if len(varying) <= 9 else 4)
    chart = _chart(f"curves-{i}", figs, fig, "No training curves: this stage logged no metrics."
                   if not curves else "Every metric this stage logged was constant.")
    flat = [c for c in curves if c.constant]
    if flat:
        chart += ('<p class="note">Constant over the stage: '
                  + ", ".join(f"{e(c.key)} = {c.values[0]:.4g}" for c in flat) + ".</p>")
    sampled = [c for c in curves if c.downsampled]
    note = ""
    if sampled:
        note = (f'<p class="note">Curves downsampled to ≤{MAX_POINTS} points per series from up to '
                f'{max(c.logged for c in sampled):,} logged steps (each bucket keeps its minimum and maximum, '
                f'so spikes survive).</p>')
    bad = [c for c in curves if c.nonfinite_steps]
    if bad:
        note += "".join(f'<p class="note warn">{e(c.key)} was non-finite at step(s) '
                        f'{", ".join(map(str, c.nonfinite_steps[:12]))}{"…" if len(c.nonfinite_steps) > 12 else ""}.</p>'
                        for c in bad)
    g = s.gap
    kv = [("kind", e(s.info.kind)),
          ("steps", f"{s.steps_seen:,}" + (f" / {s.info.steps:,}" if s.info.steps else "")),
          ("wall time", duration(s.wall_seconds)),
          ("time in phases", duration(s.phase_seconds)),
          ("% compute roof (time-weighted)", pct(g.utilization, 1) if g else "—"),
          ("% of each phase's roof", pct(g.efficiency, 1) if g else "—"),
          ("busy line", pct(g.busy) if g else "—"),
          ("eval (shown apart from the character)", pct(s.eval_share)),
          ("peak memory", si(s.mem_peak, "B"))]
    kvs = "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in kv)
    return (f'<section class="panel" id="panel-{i}" data-stage="{e(s.info.name)}" hidden>'
            f'<header><h3>{e(s.info.name)}</h3><span class="chip k-{s.character.kind}">{e(s.character.tag)}</span>'
            f'<span class="muted">{e(s.character.detail)}</span></header>'
            f'<dl class="kv">{kvs}</dl>'
            f'<h4>Phases</h4>{_phase_table(s, names)}{_consumers(s)}'
            f'<h4>Training curves</h4>{chart}{note}'
            f'<h4>Evals of this checkpoint</h4>{_stage_evals(table, s.info.name)}</section>')


def _consumers(s: StageSummary) -> str:
    if not s.consumers:
        return ""
    items = ", ".join(f"{e(k)} {si(v, 'B')}" for k, v in s.consumers.items())
    return f'<p class="note">Largest known holders of memory (memory.jsonl): {items}.</p>'


def _base_panel(run: RunData, table: EvalTable) -> str:
    model = run.recipe.get("model") or {}
    init = model.get("init", "—")
    return (f'<section class="panel" id="panel-base" data-stage="{BASE}" hidden>'
            f'<header><h3>{BASE}</h3><span class="chip k-unknown">starting checkpoint</span>'
            f'<span class="muted">model.init = {e(str(init))}</span></header>'
            f'<h4>Evals of this checkpoint</h4>{_stage_evals(table, BASE)}</section>')


def _eval_note(s: StageSummary) -> str:
    return (f'<span class="node-meta eval-share">+ eval {pct(s.eval_share)} of its time</span>'
            if s.eval_share >= 0.005 else "")


def _pipeline(run: RunData, summaries: list[StageSummary], table: EvalTable, figs: dict[str, Any], names: list[str]) -> str:
    init = (run.recipe.get("model") or {}).get("init", "")
    nodes = [(f'<button class="node" data-panel="panel-base"><span class="node-kind">{BASE}</span>'
              f'<span class="node-name">{e(str(init)) or BASE}</span><span class="chip k-unknown">start</span></button>')]
    panels = [_base_panel(run, table)]
    for i, s in enumerate(summaries):
        nodes.append(
            f'<button class="node" data-panel="panel-{i}"><span class="node-kind">{e(s.info.kind)}</span>'
            f'<span class="node-name">{e(s.info.name)}</span>'
            f'<span class="node-meta">{s.steps_seen:,} steps · {duration(s.wall_seconds)}</span>'
            f'{_share_bar(s, names)}<span class="chip k-{s.character.kind}">{e(s.character.tag)}</span>'
            f'{_eval_note(s)}</button>')
        panels.append(_stage_panel(i, s, run, table, figs, names))
    path = '<span class="arrow">→</span>'.join(nodes)
    legend = "".join(f'<span><i class="dot" style="background:{charts.phase_color(n, names)}"></i>{e(n)}</span>' for n in names)
    return (f'<section id="pipeline"><h2><span class="secnum">1</span>The pipeline</h2>'
            f'<p class="lede">Each stage carries the character its phases <em>measured</em> on this device: the '
            f'training phases it ran, then the verdict of the longest (an RL stage — one that generates and '
            f'updates — is drawn in purple). Evaluation is measurement, not training: its share of a stage\'s time '
            f'is shown beside the character, never as it. Click a stage for its time, phases, curves and evals.</p>'
            f'<div class="path">{path}</div><div class="legend">{legend}</div>{"".join(panels)}</section>')


# ---- 2. one RL iteration ------------------------------------------------------------------------------------

def _projection_data(it: RLIteration, peak_known: bool) -> dict[str, Any]:
    return {"stage": it.stage, "peak_known": peak_known,
            "rollout": list(ROLLOUT_PHASES), "update": list(UPDATE_PHASES),
            "measured_ratio": it.pooled.rollout_update_ratio,
            "phases": [{"name": p.name, "seconds": p.seconds, "u": p.utilization, "busy": p.busy}
                       for p in it.pooled.phases]}


def _lanes_sentence(it: RLIteration) -> str:
    """Each worker's busy fraction of the drawn step's window and of the whole stage, in words."""
    if it.lanes is None:
        return ""
    whole = {lane.worker: lane.fraction for lane in it.stage_lanes.lanes} if it.stage_lanes else {}
    parts = [f"<b>{e(lane.worker)}</b> {pct(lane.fraction)}"
             + (f" (stage average {pct(whole[lane.worker])})" if lane.worker in whole else "")
             for lane in it.lanes.lanes]
    one = len(it.lanes.lanes) == 1
    return (f"The same step by real start time over its window of {duration(it.lanes.seconds)} (its first phase "
            f"to the next step's first), one row per worker, gaps drawn as <em>idle</em>. Busy: {', '.join(parts)}. "
            + ("One worker: the gaps are host time between its phases." if one else
               "In synchronous RL one worker idles while another works (busy fractions summing to about 1 per "
               "pair); run asynchronously they overlap."))


def _rl_block(j: int, it: RLIteration, run: RunData, figs: dict[str, Any], projections: list[Any], names: list[str]) -> str:
    pf, pb = run.peak_flops, run.peak_bytes_per_s
    measured = it.pooled.rollout_update_ratio or 1.0
    initial = min(SLIDER_RATIOS[-1], max(SLIDER_RATIOS[0], round(measured)))
    # The curve the slider moves along: Python's projection at every slider stop (the JS mirrors `gap`).
    records = [r for r in run.stage_phases(it.stage) if r.name not in EVAL_PHASES]
    proj = gap(records, peak_flops=pf, peak_bytes_per_s=pb, ratios=SLIDER_RATIOS).projections
    figs[f"timeline-{j}"] = charts.timeline_figure(it)
    workers = ""
    if it.lanes is not None:
        figs[f"workers-{j}"] = charts.workers_figure(it.lanes, it.step, names)
        workers = (f'<h4>Step {it.step} by worker</h4><p class="lede">{_lanes_sentence(it)}</p>'
                   f'<div class="chart" id="workers-{j}" data-fig="workers-{j}"></div>')
    figs[f"projection-{j}"] = charts.projection_figure(it, SLIDER_RATIOS, [p.utilization for p in proj],
                                                       [p.busy for p in proj], initial)
    projections.append(_projection_data(it, pf is not None))
    c = it.cycle
    facts = (f"step {it.step} of {e(it.stage)} (median phase time among {it.pooled_steps} "
             f"rollout+update steps): {duration(c.seconds)} — busy line {pct(c.busy)}, achieved "
             f"{pct(c.efficiency, 1)} of each phase's roof, {pct(c.utilization, 2)} of the compute roof")
    legend = "".join(f'<span><i class="dot" style="background:{charts.phase_color(n, names)}"></i>{e(n)}</span>'
                     for n in dict.fromkeys(p.name for p in it.pooled.phases))
    lo, hi = SLIDER_RATIOS[0], SLIDER_RATIOS[-1]
    ticks = "".join(f'<span style="left:{100 * (r - lo) / (hi - lo):.2f}%">{r}:1</span>' for r in (1, 5, 10, 15, 20))
    return (f'<div class="rl" data-rl="{j}"><h3>{e(it.stage)}</h3><p class="lede">{facts}.</p>'
            f'<div class="chart" id="timeline-{j}" data-fig="timeline-{j}"></div>{workers}'
            f'<div class="rl-grid"><div class="slider-box"><div class="slider-head">'
            f'<label for="ratio-{j}">rollout : update time ratio</label>'
            f'<output id="ratio-out-{j}" class="big">{initial}:1</output>'
            f'<span class="muted">measured {measured:.2f}:1, rates pooled over {it.pooled_steps} steps</span></div>'
            f'<input type="range" id="ratio-{j}" class="ratio" data-rl="{j}" min="{SLIDER_RATIOS[0]}" max="{SLIDER_RATIOS[-1]}" step="1" value="{initial}">'
            f'<div class="ticks">{ticks}</div>'
            f'<div class="readout"><div><dt>projected cycle average, % of compute roof</dt>'
            f'<dd id="proj-u-{j}" class="big" data-value="">—</dd></div>'
            f'<div><dt>projected busy line</dt><dd id="proj-busy-{j}" class="big" data-value="">—</dd></div></div>'
            f'<div class="sharebar wide" id="proj-bar-{j}"></div><div class="legend">{legend}</div></div>'
            f'<div class="chart" id="projection-{j}" data-fig="projection-{j}"></div></div></div>')


def _rl_section(run: RunData, its: list[RLIteration], figs: dict[str, Any], projections: list[Any], names: list[str]) -> str:
    if not its:
        return ('<section id="rl" class="none"><h2><span class="secnum">2</span>One RL iteration</h2>'
                '<p class="muted">This run has no RL stage: no stage both generated and updated (a DPO-family '
                'step — reference + update — generates nothing, so it has no rollout:update ratio).</p></section>')
    blocks = "".join(_rl_block(j, it, run, figs, projections, names) for j, it in enumerate(its))
    return (f'<section id="rl"><h2><span class="secnum">2</span>One RL iteration</h2>'
            f'<p class="lede">A representative step laid out in time. The busy line (what a dashboard shows) '
            f'stays flat across phases whose achieved rate is far apart. The slider holds every phase\'s '
            f'measured rate and rescales rollout time (generate, score, reference) against update time.</p>'
            f'{blocks}</section>')


# ---- 3–5 -------------------------------------------------------------------------------------------------------

def _roofline(run: RunData, summaries: list[StageSummary], figs: dict[str, Any], n: int) -> str:
    peaks = run.peaks
    fig = charts.roofline_figure(summaries, peaks_flops=peaks.flops, dtype=run.dtype, peak_bytes_per_s=peaks.bytes_per_s)
    off = sorted({f"{s.info.name} · {r.name}" for s in summaries for r in s.phases if r.intensity is None or r.flops_per_s is None})
    note = (f'<p class="note">Not on the chart (no FLOPs and bytes declared): {e(", ".join(off))}.</p>' if off else "")
    roofs = (f"{e(peaks.name)} ({e(peaks.kind)}), {e(run.dtype)}: compute roof {si(run.peak_flops, 'FLOP/s')}, "
             f"bandwidth roof {si(peaks.bytes_per_s, 'B/s')}"
             + (f", ridge {run.peak_flops / peaks.bytes_per_s:.3g} FLOP/B" if run.peak_flops and peaks.bytes_per_s else ""))
    revised = "".join(f'<p class="note warn revision">Roof revised: {e(r.sentence())}. Every percentage on this '
                      f'page is against the revised roof; a rate above a roof means the roof was measured low '
                      f'(a busy machine) or the phase declared more work than it did.</p>' for r in run.revisions)
    return (f'<section id="roofline"><h2><span class="secnum">{n}</span>The roofline</h2>'
            f'<p class="lede">{roofs}. One point per phase per stage, pooled over its steps.</p>{revised}'
            f'{_chart("roofline-fig", figs, fig, "No phase declared a cost and no peaks are known: nothing to place.")}'
            f'{note}<p class="note">Peaks: {e(peaks.source or "unknown")}</p></section>')


def _memory(run: RunData, summaries: list[StageSummary], figs: dict[str, Any], n: int) -> str:
    kind = (run.device or {}).get("memory")
    fig = charts.memory_figure(run.phases, [s.info.name for s in summaries], kind)
    what = {"rss": "the process's peak resident set (the kernel's VmHWM, reset at each phase start)",
            "rss-sampled": "the process's resident set, sampled (a lower bound of the peak)",
            "cuda": "the device's peak allocated memory (torch.cuda.max_memory_allocated, reset per phase)"}.get(
                kind or "", "peak memory")
    rows = "".join(f'<tr><td>{e(s.info.name)}</td><td>{si(s.mem_peak, "B")}</td><td>'
                   + (", ".join(f"{e(k)} {si(v, 'B')}" for k, v in (s.consumers or {}).items()) or "—")
                   + "</td></tr>" for s in summaries)
    table = ('<table class="data num"><thead><tr><th>stage</th><th>peak memory</th><th>largest known holders</th>'
             f'</tr></thead><tbody>{rows}</tbody></table>' if summaries else "")
    return (f'<section id="memory"><h2><span class="secnum">{n}</span>Memory</h2>'
            f'<p class="lede">Peak memory of every phase along the run: {e(what)}. A phase\'s peak includes '
            f'its nested phases.</p>'
            f'{_chart("memory-fig", figs, fig, "No memory recorded (a run from before memory was measured).")}'
            f'{table}</section>')


def _cell_value(c: Any) -> str:
    if c.value is None or not math.isfinite(c.value):
        return "—"
    se = f" ±{100 * c.stderr:.1f}" if c.stderr is not None and math.isfinite(c.stderr) else ""
    return f'{100 * c.value:.1f}%<small>{se}{f" n={c.n}" if c.n else ""}</small>'


def _delta(m: Move | None) -> str:
    """Δ from the previous checkpoint, coloured up/down when beyond two standard errors (report/eval_bisect.py)."""
    if m is None:
        return ""
    cls = m.verdict if m.verdict in ("up", "down") else "flat"
    return f'<span class="delta {cls}">{100 * m.delta:+.1f}</span>'


def _evals(table: EvalTable, figs: dict[str, Any], n: int) -> str:
    if not table.columns:
        return (f'<section id="evals"><h2><span class="secnum">{n}</span>Evals across the pipeline</h2>'
                f'<p class="muted">No evals recorded (evals.jsonl is empty or absent).</p></section>')
    th = "<th>eval</th>" + "".join(f"<th>{e(c)}</th>" for c in table.columns) + "<th>first drop</th>"
    rows = []
    for track in bisect_table(table):
        moves = {m.after: m for m in track.moves}
        cells = []
        for col in table.columns:
            c = table.cell(col, track.row)
            cells.append("<td></td>" if c is None else f"<td>{_cell_value(c)}{_delta(moves.get(col))}</td>")
        drop = f'<span class="delta down">{e(track.first_drop)}</span>' if track.first_drop else "—"
        rows.append(f"<tr><td>{e(charts.eval_row_label(track.row))}</td>{''.join(cells)}<td>{drop}</td></tr>")
    return (f'<section id="evals"><h2><span class="secnum">{n}</span>Evals across the pipeline</h2>'
            f'<p class="lede">The same held-out evals on every checkpoint; Δ is the change from the previous '
            f'checkpoint in points, coloured when it exceeds two standard errors of the difference '
            f'(√(se₁² + se₂²); uncoloured when a side has no standard error); <em>first drop</em> names the first '
            f'checkpoint where the number fell beyond that — the stage to look at (also: <code>posttrain bisect</code>).</p>'
            f'<table class="data num bisect"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
            f'{_chart("evals-fig", figs, charts.evals_figure(table), "")}</section>')


def _doctor(doctor: Any, n: int, figs: dict[str, Any]) -> str:
    return doctor_section(doctor, n, figs)


# ---- the page ----------------------------------------------------------------------------------------------------

def render(run: RunData) -> str:
    summaries = summarize(run)
    table = eval_table(run)
    its = rl_iterations(run)
    names = list(dict.fromkeys(r.name for s in summaries for r in s.phases))
    figs: dict[str, Any] = {}
    projections: list[Any] = []
    sections = [_pipeline(run, summaries, table, figs, names), _rl_section(run, its, figs, projections, names)]
    sections += [_roofline(run, summaries, figs, 3), _memory(run, summaries, figs, 4), _evals(table, figs, 5),
                 _doctor(run.doctor, 6, figs)]
    total = sum(s.wall_seconds or 0.0 for s in summaries)
    peaks = run.peaks
    title = str(run.recipe.get("name") or run.run_dir.name)
    missing = (f'<p class="note warn">Missing from the run folder: {e(", ".join(run.missing))}.</p>' if run.missing else "")
    header = (f'<header class="top"><div><div class="brand">posttrain · run report</div><h1>{e(title)}</h1>'
              f'<p class="muted mono">{e(str(run.run_dir))}</p></div>'
              f'<dl class="kv head">'
              f'<div><dt>stages</dt><dd>{" → ".join(e(s.info.name) for s in summaries) or "—"}</dd></div>'
              f'<div><dt>time in stages</dt><dd>{duration(total)}</dd></div>'
              f'<div><dt>device</dt><dd>{e(peaks.name)} · {e(run.dtype)}</dd></div>'
              f'<div><dt>roofs</dt><dd>{si(run.peak_flops, "FLOP/s")} · {si(peaks.bytes_per_s, "B/s")}'
              f'{" <span class=chip>revised</span>" if run.revisions else ""}</dd></div>'
              f'</dl></header>{missing}')
    nav = ('<nav>' + "".join(f'<a href="#{i}">{t}</a>' for i, t in
                             [("pipeline", "Pipeline"), ("rl", "RL iteration"), ("roofline", "Roofline"),
                              ("memory", "Memory"), ("evals", "Evals"), ("doctor", "Doctor")]) + '</nav>')
    data = json.dumps(_json_safe({"figures": figs, "projections": projections,
                                  "colors": {n: charts.phase_color(n, names) for n in names}}), allow_nan=False, separators=(",", ":"))
    data = data.replace("</", "<\\/")
    fields = {"TITLE": e(f"{title} — posttrain report"), "CSS": _asset("report.css"), "PLOTLY": _plotly_js(),
              "DATA": data, "JS": _asset("report.js"),
              "BODY": header + nav + "".join(sections) +
                      f'<footer>Written by posttrain.report on {time.strftime("%Y-%m-%d %H:%M")} from the run folder alone.</footer>'}
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda m: fields[m.group(1)], _asset("template.html"))


def write_report(run_dir: str | Path) -> Path:
    """Write `run_dir/report.html` from the run folder's records; returns its path."""
    run = load_run(run_dir)
    out = run.run_dir / "report.html"
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(render(run), encoding="utf-8")
    tmp.replace(out)
    return out
