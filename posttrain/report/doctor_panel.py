"""The report's doctor section: each finding of doctor.json as a card (severity, what was seen, why,
what to try, the source) with its evidence plotted — one small chart per curve, the window that
triggered the rule shaded, the level it was compared against dashed.

Reads doctor.json as written by posttrain.doctor (`{"findings": [...], "stopped": …, "cost": …}`);
anything else it shows as JSON rather than failing the report.
"""

from __future__ import annotations

import html
import json
from typing import Any

from posttrain.report.charts import INK, MUTED, Figure, _axis, _layout

e = html.escape
SEVERITY_COLORS = {"critical": "#e03131", "warning": "#f08c00", "info": "#1c7ed6"}


def evidence_figure(finding: dict[str, Any]) -> Figure | None:
    """Small multiples, one row per evidence curve; checkpoint comparisons (labels) as paired bars."""
    evs = [ev for ev in finding.get("evidence", []) if isinstance(ev, dict) and ev.get("steps")]
    if not evs:
        return None
    color = SEVERITY_COLORS.get(str(finding.get("severity")), "#868e96")
    n = len(evs)
    gap = 0.30 / n if n > 1 else 0.0
    h = (1 - gap * (n - 1)) / n
    layout = _layout(height=150 * n + 40, showlegend=False, margin={"l": 56, "r": 12, "t": 22, "b": 30})
    data, shapes, notes = [], [], []
    for k, ev in enumerate(evs):
        ax = "" if k == 0 else str(k + 1)
        top = 1 - k * (h + gap)
        layout[f"xaxis{ax}"] = _axis(domain=[0, 1], anchor=f"y{ax}", tickfont={"size": 10},
                                     **({"matches": "x"} if k and not ev.get("labels") else {}))
        layout[f"yaxis{ax}"] = _axis(domain=[top - h, top], anchor=f"x{ax}", tickfont={"size": 10}, exponentformat="SI")
        metric = str(ev.get("metric", ""))
        if ev.get("labels"):
            data.append({"type": "bar", "x": ev["labels"], "y": ev["values"], "xaxis": f"x{ax}", "yaxis": f"y{ax}",
                         "marker": {"color": ["#adb5bd", color][: len(ev["values"])]}, "name": metric,
                         "hovertemplate": f"{e(metric)}<br>%{{x}}: %{{y:.4g}}<extra></extra>"})
        else:
            lo, hi = ev.get("window", [None, None])
            if lo is not None and hi is not None:
                pad = 0.5 if lo == hi else 0.0
                shapes.append({"type": "rect", "xref": f"x{ax}", "yref": f"y{ax} domain", "x0": lo - pad, "x1": hi + pad,
                               "y0": 0, "y1": 1, "fillcolor": color, "opacity": 0.12, "line": {"width": 0}, "layer": "below"})
            first = finding.get("first_step")
            if isinstance(first, int) and first > 0:  # where the signature began
                shapes.append({"type": "line", "xref": f"x{ax}", "yref": f"y{ax} domain", "x0": first, "x1": first,
                               "y0": 0, "y1": 1, "line": {"color": color, "width": 1.5, "dash": "dot"}})
            if ev.get("reference") is not None:
                shapes.append({"type": "line", "xref": f"x{ax} domain", "yref": f"y{ax}", "x0": 0, "x1": 1,
                               "y0": ev["reference"], "y1": ev["reference"], "line": {"color": MUTED, "width": 1, "dash": "dash"}})
            data.append({"type": "scatter", "mode": "lines+markers" if len(ev["steps"]) <= 40 else "lines",
                         "x": ev["steps"], "y": ev["values"], "xaxis": f"x{ax}", "yaxis": f"y{ax}", "name": metric,
                         "line": {"width": 1.6, "color": INK}, "marker": {"size": 4},
                         "hovertemplate": f"{e(metric)}<br>step %{{x}}: %{{y:.4g}}<extra></extra>"})
        notes.append({"text": f"<b>{e(metric)}</b>", "xref": f"x{ax} domain", "yref": f"y{ax} domain", "x": 0, "y": 1.02,
                      "xanchor": "left", "yanchor": "bottom", "showarrow": False, "font": {"size": 11, "color": INK}})
    layout["shapes"] = shapes
    layout["annotations"] = notes
    return {"data": data, "layout": layout}


def doctor_section(doctor: Any, n: int, figs: dict[str, Any]) -> str:
    head = f'<section id="doctor"><h2><span class="secnum">{n}</span>Doctor</h2>'
    if doctor is None:
        return head + '<p class="muted">No findings: this run has no doctor.json (`posttrain doctor RUN_DIR` writes it).</p></section>'
    findings = doctor if isinstance(doctor, list) else (doctor.get("findings") if isinstance(doctor, dict) else None)
    if not isinstance(findings, list):
        return head + f'<pre class="note">{e(json.dumps(doctor, indent=2)[:4000])}</pre></section>'
    parts = [head]
    stopped = doctor.get("stopped") if isinstance(doctor, dict) else None
    if isinstance(stopped, dict):
        parts.append(f'<p class="note warn"><b>The doctor stopped this run</b> in {e(str(stopped.get("stage")))} '
                     f'({e(str(stopped.get("rule")))}, from step {e(str(stopped.get("first_step")))}): '
                     f'{e(str(stopped.get("reason")))}. Last good checkpoint: '
                     f'<span class="mono">{e(str(stopped.get("last_good_checkpoint")))}</span>.</p>')
    if not findings:
        parts.append('<p class="muted">The doctor found nothing to report.</p>')
    for i, f in enumerate(findings):
        if not isinstance(f, dict):
            parts.append(f'<div class="finding"><p>{e(str(f))}</p></div>')
            continue
        sev = str(f.get("severity", ""))
        title = str(f.get("rule") or f.get("title") or "finding")
        rows = [(k, f[k]) for k in ("summary", "explanation", "mitigation", "source") if f.get(k)]
        if not rows:  # a doctor.json of another shape: show its fields
            rows = [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in f.items() if k not in ("rule", "severity")]
        labels = {"summary": "seen", "explanation": "why", "mitigation": "try", "source": "source"}
        dl = "".join(f"<div><dt>{e(labels.get(k, k))}</dt><dd>{e(str(v))}</dd></div>" for k, v in rows)
        fig = evidence_figure(f)
        chart = ""
        if fig is not None:
            fig_id = f"doctor-fig-{i}"
            figs[fig_id] = fig
            chart = f'<div class="chart" id="{fig_id}" data-fig="{fig_id}"></div>'
        where = f' · {e(str(f.get("stage")))}' + (f' · from step {e(str(f["first_step"]))}' if f.get("first_step") else "")
        parts.append(f'<div class="finding sev-{e(sev)}" style="border-left-color:{SEVERITY_COLORS.get(sev, "#868e96")}">'
                     f'<h4>{e(title)}{where}{f" <span class=chip>{e(sev)}</span>" if sev else ""}</h4>'
                     f'<dl class="kv">{dl}</dl>{chart}</div>')
    cost = doctor.get("cost") if isinstance(doctor, dict) else None
    if isinstance(cost, dict) and cost:
        spent = "; ".join(f"{e(str(k))} {float(v.get('seconds', 0)):.3f} s of {float(v.get('stage_seconds', 0)):.0f} s "
                          f"({100 * float(v.get('share', 0)):.3f}%)" for k, v in cost.items() if isinstance(v, dict))
        parts.append(f'<p class="muted">Live doctor cost: {spent}.</p>')
    return "".join(parts) + "</section>"
