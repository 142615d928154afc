"""Check a finished run folder: no phase above 100% of a roof anywhere it is shown.

    python scripts/check_roofs.py RUN_DIR [--posttrain PATH]

Reads metrics.jsonl (`pct_*` keys), `posttrain phases RUN_DIR` at 80 and 160 columns (the "% compute
roof" / "% bandwidth roof" cells, i.e. %C / %B), and report.html's visible text (scripts and styles
removed: they hold chart data and CSS); prints device.json's roof revisions and where the page states
them. Exit 1 when any roof percentage exceeds 100.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PCT = re.compile(r"(\d+(?:\.\d+)?)\s*%")


def metrics_max(run: Path) -> tuple[int, float]:
    values = [v for line in (run / "metrics.jsonl").read_text().splitlines()
              for k, v in json.loads(line).items() if "pct_" in k and isinstance(v, (int, float))]
    return len(values), max(values, default=0.0)


def cli_roof_cells(run: Path, exe: str, columns: int) -> list[float]:
    """The roof cells of each stage table: columns 7 and 8 of a row (phase, share, s, GFLOP/s, GB/s, F/B, %C, %B)."""
    out = subprocess.run([exe, "phases", str(run)], capture_output=True, text=True, check=True,
                         env={**os.environ, "COLUMNS": str(columns)}).stdout
    cells: list[float] = []
    for line in out.splitlines():
        boxed = "│" in line or "┃" in line  # wide tables are boxed; below 120 columns they are plain
        parts = [p.strip() for p in re.split(r"[│┃]", line) if p.strip()] if boxed else line.split()
        if len(parts) >= 8:
            cells += [float(m.group(1)) for p in parts[6:8] if (m := PCT.fullmatch(p))]
    return cells


def report_visible_max(run: Path) -> float:
    html = (run / "report.html").read_text()
    body = re.sub(r"<(script|style)\b.*?</\1>", "", html, flags=re.S)
    return max((float(m) for m in PCT.findall(body)), default=0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--posttrain", default=shutil.which("posttrain") or "posttrain")
    a = ap.parse_args()
    n, mx = metrics_max(a.run)
    print(f"metrics.jsonl: {n} pct values, max {mx:.2f}")
    worst = mx
    for cols in (80, 160):
        cells = cli_roof_cells(a.run, a.posttrain, cols)
        print(f"posttrain phases at {cols} columns: {len(cells)} roof cells, max {max(cells, default=0):.1f}")
        worst = max(worst, *cells, 0.0)
    visible = report_visible_max(a.run)
    print(f"report.html visible percentages: max {visible:.1f} (accuracies and time shares included)")
    worst = max(worst, visible)
    revisions = json.loads((a.run / "device.json").read_text()).get("revisions") or []
    print(f"device.json revisions: {revisions or 'none'}")
    print("OK: nothing above 100%" if worst <= 100.0 else f"FAIL: {worst:.1f}% shown")
    return 0 if worst <= 100.0 else 1


if __name__ == "__main__":
    sys.exit(main())
