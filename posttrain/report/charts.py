"""Plotly figures of the report, as plain `{"data": [...], "layout": {...}}` dicts (Plotly's JSON schema).

Built as dicts rather than `plotly.graph_objects` so a 1,000-step report costs no validation time; the
page hands each to `Plotly.newPlot`. Colours: one per phase name (the same in every chart), one per
verdict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from posttrain.report._format import si
from posttrain.report.curves import Curve
from posttrain.report.summaries import EvalTable, RLIteration, StageSummary
from posttrain.telemetry.lanes import IDLE, Lane, Lanes
from posttrain.worlds.arithmetic import LEVELS

Figure = dict[str, Any]

PHASE_COLORS = {"generate": "#e8590c", "tool": "#fab005", "score": "#ae3ec9", "reference": "#0c8599", "update": "#1c7ed6",
                "sync": "#5c940d", "eval": "#868e96"}
_MORE_COLORS = ("#f59f00", "#d6336c", "#37b24d", "#4263eb", "#74b816", "#15aabf", "#495057")
BOUND_COLORS = {"compute": "#2f9e44", "memory": "#f08c00", "overhead": "#e03131", "unknown": "#868e96",
                "rl": "#7048e8"}
INK, MUTED, GRID = "#1f2329", "#6b7280", "#e9ecef"
FONT = "Inter, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
STAGE_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "star", "hexagon", "pentagon")


def phase_color(name: str, order: Sequence[str] = ()) -> str:
    if name in PHASE_COLORS:
        return PHASE_COLORS[name]
    others = [n for n in order if n not in PHASE_COLORS]
    i = others.index(name) if name in others else sum(map(ord, name))
    return _MORE_COLORS[i % len(_MORE_COLORS)]


def eval_row_label(row: tuple[str, str | None, str]) -> str:
    name, level, metric = row
    if level is None:
        return f"{name} · {metric}"
    return f"{name} {level}{' (' + LEVELS[level] + ')' if level in LEVELS else ''} · {metric}"


def _layout(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "font": {"family": FONT, "size": 12, "color": INK},
        "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "#ffffff",
        "margin": {"l": 56, "r": 16, "t": 16, "b": 44},
        "hoverlabel": {"font": {"family": FONT}},
        "legend": {"orientation": "h", "y": -0.18, "x": 0, "font": {"size": 11}},
    }
    base.update(over)
    return base


def _axis(**over: Any) -> dict[str, Any]:
    a: dict[str, Any] = {"gridcolor": GRID, "zeroline": False, "linecolor": "#ced4da", "ticks": "outside",
                         "tickcolor": "#ced4da", "automargin": True}
    a.update(over)
    return a


# ---- a stage's training curves: small multiples --------------------------------------------------------

def curves_figure(curves: Sequence[Curve], cols: int = 3) -> Figure | None:
    if not curves:
        return None
    cols = min(cols, len(curves))
    rows = math.ceil(len(curves) / cols)
    gx, gy = 0.06, 0.30 / rows if rows > 1 else 0.0
    w, h = (1 - gx * (cols - 1)) / cols, (1 - gy * (rows - 1)) / rows
    data, layout = [], _layout(height=190 * rows + 30, showlegend=False, margin={"l": 44, "r": 8, "t": 26, "b": 30})
    annotations = []
    for k, c in enumerate(curves):
        r, col = divmod(k, cols)
        ax = "" if k == 0 else str(k + 1)
        x0 = col * (w + gx)
        y1 = 1 - r * (h + gy)
        layout[f"xaxis{ax}"] = _axis(domain=[x0, x0 + w], anchor=f"y{ax}", tickfont={"size": 10})
        layout[f"yaxis{ax}"] = _axis(domain=[y1 - h, y1], anchor=f"x{ax}", tickfont={"size": 10},
                                     exponentformat="SI")
        sparse = len(c.steps) <= 20 or c.key.startswith("eval/")
        data.append({"type": "scatter", "mode": "lines+markers" if sparse else "lines", "x": c.steps, "y": c.values,
                     "xaxis": f"x{ax}", "yaxis": f"y{ax}", "name": c.key,
                     "line": {"width": 1.6, "color": "#1c7ed6"}, "marker": {"size": 4},
                     "hovertemplate": f"{c.key}<br>step %{{x}}: %{{y:.4g}}<extra></extra>"})
        title = c.key + (f"  ({len(c.nonfinite_steps)} non-finite)" if c.nonfinite_steps else "")
        annotations.append({"text": f"<b>{title}</b>", "xref": f"x{ax} domain", "yref": f"y{ax} domain",
                            "x": 0, "y": 1.02, "xanchor": "left", "yanchor": "bottom", "showarrow": False,
                            "font": {"size": 11, "color": "#e03131" if c.nonfinite_steps else INK}})
    layout["annotations"] = annotations
    return {"data": data, "layout": layout}


# ---- one RL iteration along a time axis ------------------------------------------------------------------

def _step_line(it: RLIteration, value: str) -> tuple[list[float | None], list[float | None]]:
    xs: list[float | None] = []
    ys: list[float | None] = []
    for s in it.segments:
        v = getattr(s, value)
        if v is None:
            xs.append(None)
            ys.append(None)
            continue
        xs += [s.x0, s.x1]
        ys += [100 * v, 100 * v]
    return xs, ys


def timeline_figure(it: RLIteration) -> Figure:
    """The drawn cycle: phase bands, the busy line, the achieved line (% of the roof its intensity
    allows) and the cycle averages of both."""
    end = it.segments[-1].x1 if it.segments else 1.0
    names = list(dict.fromkeys(s.name for s in it.segments))
    shapes, annotations = [], []
    for s in it.segments:
        color = phase_color(s.name, names)
        shapes.append({"type": "rect", "xref": "x", "yref": "y", "x0": s.x0, "x1": s.x1, "y0": 0, "y1": 100,
                       "fillcolor": color, "opacity": 0.14, "line": {"width": 0}, "layer": "below"})
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": s.x0, "x1": s.x1, "y0": 1.0,
                       "y1": 1.05, "fillcolor": color, "opacity": 0.9, "line": {"width": 1, "color": "#fff"}})
        if (s.x1 - s.x0) / end > 0.04:
            annotations.append({"text": f"<b>{s.name}</b><br>{s.bound}", "x": (s.x0 + s.x1) / 2, "y": 62,
                                "xref": "x", "yref": "y", "showarrow": False, "yanchor": "middle",
                                "font": {"size": 11, "color": color}})
    bx, by = _step_line(it, "busy")
    ex, ey = _step_line(it, "efficiency")
    data = [
        {"type": "scatter", "mode": "lines", "x": bx, "y": by, "name": "busy line (what a dashboard shows)",
         "line": {"color": "#495057", "width": 2.5}, "hovertemplate": "busy %{y:.0f}%<extra></extra>"},
        {"type": "scatter", "mode": "lines", "x": ex, "y": ey, "name": "achieved: % of the roof its intensity allows",
         "line": {"color": "#e03131", "width": 2.5}, "hovertemplate": "achieved %{y:.1f}% of its roof<extra></extra>"},
    ]
    if it.cycle.busy is not None:
        data.append({"type": "scatter", "mode": "lines", "x": [0, end], "y": [100 * it.cycle.busy] * 2,
                     "name": f"cycle average busy {100 * it.cycle.busy:.0f}%",
                     "line": {"color": "#495057", "width": 1.5, "dash": "dash"}, "hoverinfo": "skip"})
    if it.cycle.efficiency is not None:
        data.append({"type": "scatter", "mode": "lines", "x": [0, end], "y": [100 * it.cycle.efficiency] * 2,
                     "name": f"cycle average achieved {100 * it.cycle.efficiency:.1f}%",
                     "line": {"color": "#e03131", "width": 1.5, "dash": "dash"}, "hoverinfo": "skip"})
    mem = [s for s in it.segments if s.mem_peak is not None]
    if mem:
        mx: list[float | None] = []
        my: list[float | None] = []
        for s in mem:
            mx += [s.x0, s.x1]
            my += [s.mem_peak / 2**20, s.mem_peak / 2**20]
        data.append({"type": "scatter", "mode": "lines", "x": mx, "y": my, "yaxis": "y2",
                     "name": "peak memory (MiB, right axis)", "line": {"color": "#0b7285", "width": 2, "dash": "dot"},
                     "hovertemplate": "peak %{y:.1f} MiB<extra></extra>"})
    layout = _layout(height=340, shapes=shapes, annotations=annotations, margin={"l": 56, "r": 64 if mem else 16, "t": 26, "b": 44},
                     xaxis=_axis(title={"text": f"seconds into step {it.step} (phases end to end, exclusive time)"},
                                 range=[0, end]),
                     yaxis=_axis(title={"text": "%"}, range=[0, 100], ticksuffix="%"),
                     legend={"orientation": "h", "y": -0.25, "x": 0, "font": {"size": 11}})
    if mem:
        layout["yaxis2"] = _axis(title={"text": "MiB"}, overlaying="y", side="right", rangemode="tozero",
                                 showgrid=False)
    return {"data": data, "layout": layout}


def projection_figure(it: RLIteration, ratios: Sequence[float], u: Sequence[float | None],
                      busy: Sequence[float | None], initial: float) -> Figure:
    """U(r) and busy(r) over the slider's range; trace 2 is the slider's marker (moved by the page)."""
    data = []
    if any(v is not None for v in u):
        data.append({"type": "scatter", "mode": "lines", "x": list(ratios), "y": [None if v is None else 100 * v for v in u],
                     "name": "projected % of compute roof (cycle average)", "line": {"color": "#e03131", "width": 2.5},
                     "hovertemplate": "%{x}:1 → %{y:.2f}% of compute roof<extra></extra>"})
    if any(v is not None for v in busy):
        data.append({"type": "scatter", "mode": "lines", "x": list(ratios), "y": [None if v is None else 100 * v for v in busy],
                     "name": "projected busy line", "line": {"color": "#495057", "width": 2.5},
                     "hovertemplate": "%{x}:1 → busy %{y:.0f}%<extra></extra>"})
    data.append({"type": "scatter", "mode": "markers", "x": [initial], "y": [None], "name": "slider",
                 "marker": {"size": 12, "color": "#e03131", "line": {"color": "#fff", "width": 2}},
                 "showlegend": False, "hoverinfo": "skip"})
    shapes = []
    if it.pooled.rollout_update_ratio is not None:
        m = it.pooled.rollout_update_ratio
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": m, "x1": m, "y0": 0, "y1": 1,
                       "line": {"color": "#7048e8", "width": 1.5, "dash": "dot"}})
    layout = _layout(height=300, shapes=shapes,
                     annotations=[{"text": f"measured {it.pooled.rollout_update_ratio:.2f}:1",
                                   "x": math.log10(it.pooled.rollout_update_ratio), "y": 1, "xref": "x",
                                   "yref": "paper", "showarrow": False, "yanchor": "bottom",
                                   "font": {"size": 10, "color": "#7048e8"}}] if shapes else [],
                     xaxis=_axis(title={"text": "rollout : update time ratio"}, type="log",
                                 tickvals=[1, 2, 3, 5, 10, 20], ticktext=["1:1", "2:1", "3:1", "5:1", "10:1", "20:1"]),
                     yaxis=_axis(title={"text": "%"}, rangemode="tozero", ticksuffix="%"),
                     legend={"orientation": "h", "y": -0.32, "x": 0, "font": {"size": 11}},
                     margin={"l": 56, "r": 16, "t": 22, "b": 44})
    return {"data": data, "layout": layout}


# ---- one RL iteration, one lane per worker ----------------------------------------------------------------

IDLE_COLOR = "#dee2e6"


def lane_label(lane: Lane) -> str:
    """The y tick of a lane: the worker and its busy fraction of the window, e.g. "rollout0 · 50% busy"."""
    return f"{lane.worker} · {100 * lane.fraction:.0f}% busy"


def workers_figure(lanes: Lanes, step: int, names: Sequence[str] = ()) -> Figure:
    """Step `step` by real start time: one row per worker (learner, ranks, rollout workers), each phase a
    bar from its start, the gaps drawn as `idle` — in sync RL one worker idles while the other works; in
    async RL they overlap."""
    order = list(names) or list(dict.fromkeys(s.name for lane in lanes.lanes for s in lane.spans))
    labels = {lane.worker: lane_label(lane) for lane in lanes.lanes}
    by_name: dict[str, list[tuple[Lane, Any]]] = {}
    for lane in lanes.lanes:
        for span in lane.spans:
            by_name.setdefault(span.name, []).append((lane, span))
    data = []
    for name, items in sorted(by_name.items(), key=lambda kv: kv[0] == IDLE):  # idle last in the legend
        idle = name == IDLE
        data.append({
            "type": "bar", "orientation": "h", "name": name,
            "y": [labels[lane.worker] for lane, _ in items],
            "x": [span.seconds for _, span in items], "base": [span.x0 - lanes.start for _, span in items],
            "marker": {"color": IDLE_COLOR if idle else phase_color(name, order),
                       "line": {"color": "#fff", "width": 1},
                       **({"pattern": {"shape": "/", "fgcolor": "#adb5bd", "size": 6}} if idle else {})},
            "customdata": [[span.step, span.x0 - lanes.start] for _, span in items],
            "hovertemplate": (f"<b>{name}</b>" + ("" if idle else " (step %{customdata[0]})")
                              + "<br>from %{customdata[1]:.3f} s, %{x:.3f} s long<extra>%{y}</extra>"),
        })
    rows = [labels[lane.worker] for lane in lanes.lanes]
    layout = _layout(height=100 + 44 * len(rows), barmode="overlay", bargap=0.25,
                     margin={"l": 150, "r": 16, "t": 34, "b": 44},
                     legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom", "font": {"size": 11}},
                     xaxis=_axis(title={"text": f"seconds into step {step}'s window ({lanes.seconds:.3g} s: its first "
                                                "phase to the next step's first), real start times"},
                                 range=[0, lanes.seconds]),
                     yaxis=_axis(categoryorder="array", categoryarray=rows[::-1], type="category"))
    return {"data": data, "layout": layout}


# ---- the roofline ------------------------------------------------------------------------------------------

def roofline_figure(summaries: Sequence[StageSummary], *, peaks_flops: dict[str, float], dtype: str,
                    peak_bytes_per_s: float | None) -> Figure | None:
    """Log-log roofline of the device with one point per (stage, phase) that declared FLOPs and bytes."""
    points = [(s, r) for s in summaries for r in s.phases if r.intensity is not None and r.flops_per_s is not None]
    peak = peaks_flops.get(dtype)
    if not points and not (peak and peak_bytes_per_s):
        return None
    xs = [r.intensity for _, r in points if r.intensity]
    ys = [r.flops_per_s for _, r in points if r.flops_per_s]
    ridge = peak / peak_bytes_per_s if peak and peak_bytes_per_s else None
    if not points and ridge is None:
        return None
    lo = min(xs + ([ridge] if ridge else [])) / 10
    hi = max(xs + ([ridge] if ridge else [])) * 10
    data: list[dict[str, Any]] = []
    if peak_bytes_per_s:
        for name, p in sorted(peaks_flops.items(), key=lambda kv: kv[0] != dtype):
            r = p / peak_bytes_per_s
            main = name == dtype
            data.append({"type": "scatter", "mode": "lines", "x": [lo, r, max(hi, r * 10)],
                         "y": [peak_bytes_per_s * lo, p, p], "name": f"roof {name}" + (" (run dtype)" if main else ""),
                         "line": {"color": INK if main else "#adb5bd", "width": 2.5 if main else 1.2,
                                  "dash": "solid" if main else "dot"},
                         "hovertemplate": f"{name} roof: {si(p, 'FLOP/s')}, {si(peak_bytes_per_s, 'B/s')}, "
                                          f"ridge {r:.3g} FLOP/B<extra></extra>"})
    elif peak:
        data.append({"type": "scatter", "mode": "lines", "x": [lo, hi], "y": [peak, peak], "name": f"compute roof {dtype}",
                     "line": {"color": INK, "width": 2.5}})
    stages = list(dict.fromkeys(s.info.name for s, _ in points))
    names = list(dict.fromkeys(r.name for _, r in points))
    positions = ("top center", "bottom center", "middle right", "middle left", "top right", "bottom left")
    for k, (s, r) in enumerate(points):
        sym = STAGE_SYMBOLS[stages.index(s.info.name) % len(STAGE_SYMBOLS)]
        data.append({
            "type": "scatter", "mode": "markers+text", "x": [r.intensity], "y": [r.flops_per_s],
            "name": f"{s.info.name} · {r.name}", "text": [f"{s.info.name} · {r.name}"],
            "textposition": positions[k % len(positions)],
            "textfont": {"size": 11, "color": phase_color(r.name, names)},
            "marker": {"size": 13, "symbol": sym, "color": phase_color(r.name, names), "line": {"color": "#fff", "width": 1.5}},
            "hovertemplate": (f"<b>{s.info.name} · {r.name}</b><br>{si(r.flops_per_s, 'FLOP/s')} at "
                              f"{r.intensity:.3g} FLOP/B<br>{'' if r.efficiency is None else f'{100 * r.efficiency:.1f}% of its roof · '}"
                              f"{r.bound}-bound<extra></extra>")})
    top = max(ys + list(peaks_flops.values())) * 3
    bottom = min(ys + ([peak_bytes_per_s * lo] if peak_bytes_per_s else [])) / 4
    layout = _layout(height=460, margin={"l": 64, "r": 16, "t": 16, "b": 50},
                     xaxis=_axis(type="log", title={"text": "arithmetic intensity (FLOP/byte)"}, range=[math.log10(lo), math.log10(hi)],
                                 dtick=1, tickformat="~g", minor={"showgrid": True, "gridcolor": "#f5f6f7"}),
                     yaxis=_axis(type="log", title={"text": f"achieved FLOP/s ({dtype})"},
                                 range=[math.log10(bottom), math.log10(top)], dtick=1, tickformat="~s",
                                 minor={"showgrid": True, "gridcolor": "#f5f6f7"}),
                     legend={"orientation": "v", "x": 1.01, "y": 1, "font": {"size": 11}})
    return {"data": data, "layout": layout}


# ---- evals across the pipeline ------------------------------------------------------------------------------

def evals_figure(table: EvalTable) -> Figure | None:
    if not table.columns or not table.rows:
        return None
    data = []
    for row in table.rows:
        ys, errs = [], []
        for col in table.columns:
            c = table.cell(col, row)
            ok = c is not None and c.value is not None and math.isfinite(c.value)
            ys.append(100 * c.value if ok and c else None)
            errs.append(100 * c.stderr if ok and c and c.stderr is not None and math.isfinite(c.stderr) else 0)
        data.append({"type": "scatter", "mode": "lines+markers", "x": table.columns, "y": ys, "name": eval_row_label(row),
                     "error_y": {"type": "data", "array": errs, "visible": True, "thickness": 1, "width": 3},
                     "line": {"width": 2}, "marker": {"size": 7},
                     "hovertemplate": f"{eval_row_label(row)}<br>%{{x}}: %{{y:.1f}}%<extra></extra>"})
    layout = _layout(height=380, xaxis=_axis(title={"text": "checkpoint, in pipeline order"}, type="category"),
                     yaxis=_axis(title={"text": "%"}, range=[-3, 103], ticksuffix="%"),
                     legend={"orientation": "v", "x": 1.01, "y": 1, "font": {"size": 11}},
                     margin={"l": 56, "r": 16, "t": 16, "b": 50})
    return {"data": data, "layout": layout}


# ---- memory over the run --------------------------------------------------------------------------------------

MEMORY_POINTS = 1500  # per stage: beyond this, consecutive phases are bucketed keeping each bucket's peak


def memory_figure(phases: Sequence[Any], stages: Sequence[str], kind: str | None) -> Figure | None:
    """Peak memory of every phase occurrence along the run's clock, one trace per stage (hover: the phase).

    `phases` are PhaseRecords; those without `mem_peak` (a run recorded before memory was) are skipped."""
    by_stage: dict[str, list[Any]] = {}
    for r in phases:
        if r.mem_peak is not None:
            by_stage.setdefault(r.stage, []).append(r)
    if not by_stage:
        return None
    data = []
    for k, stage in enumerate([s for s in stages if s in by_stage] + [s for s in by_stage if s not in stages]):
        recs = sorted(by_stage[stage], key=lambda r: r.start)
        if len(recs) > MEMORY_POINTS:
            size = math.ceil(len(recs) / MEMORY_POINTS)
            recs = [max(recs[i : i + size], key=lambda r: r.mem_peak) for i in range(0, len(recs), size)]
        data.append({"type": "scatter", "mode": "lines+markers", "name": stage,
                     "x": [r.start for r in recs], "y": [r.mem_peak / 2**20 for r in recs],
                     "text": [f"{r.name} step {r.step}" for r in recs],
                     "line": {"width": 1.4, "shape": "hv", "color": _MORE_COLORS[k % len(_MORE_COLORS)]},
                     "marker": {"size": 5, "color": [phase_color(r.name) for r in recs]},
                     "hovertemplate": f"{stage} · %{{text}}<br>peak %{{y:.1f}} MiB<extra></extra>"})
    what = {"rss": "peak resident memory (VmHWM)", "rss-sampled": "peak resident memory (sampled)",
            "cuda": "peak allocated device memory"}.get(kind or "", "peak memory")
    layout = _layout(height=320, xaxis=_axis(title={"text": "seconds since the run started (phase start)"}),
                     yaxis=_axis(title={"text": f"{what}, MiB"}, rangemode="tozero"),
                     margin={"l": 64, "r": 16, "t": 16, "b": 44})
    return {"data": data, "layout": layout}
