"""Bodies of `posttrain roofline [--measure]` and `posttrain phases RUN_DIR` (registered in posttrain/cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from posttrain.telemetry.devices import (
    PEAKS_TABLE,
    Peaks,
    cache_path,
    detect,
    load_cpu_peaks,
    measure_cpu_peaks,
    missing_peaks_message,
)
from posttrain.telemetry.gap import gaps_by_stage
from posttrain.telemetry.lanes import stage_lanes
from posttrain.telemetry.phases import PhaseRecord, read_phases
from posttrain.telemetry.revision import net, recorded, revise
from posttrain.telemetry.roofline import place, ridge_point


def _si(value: float | None, unit: str, scale: float = 1e9, digits: int = 1) -> str:
    return "—" if value is None else f"{value / scale:,.{digits}f} {unit}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}%"


def _frac(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _roofs_table(peaks: Peaks) -> Table:
    table = Table(title=f"{peaks.name} ({peaks.kind})")
    for col in ("dtype", "peak compute", "peak bandwidth", "ridge point"):
        table.add_column(col, justify="right" if col != "dtype" else "left")
    for dtype, flops in peaks.flops.items():
        ridge = ridge_point(flops, peaks.bytes_per_s) if peaks.bytes_per_s else None
        table.add_row(dtype, _si(flops, "GFLOP/s"), _si(peaks.bytes_per_s, "GB/s"),
                      "—" if ridge is None else f"{ridge:.1f} FLOP/B")
    if not peaks.flops:
        table.add_row("—", "unknown peak", _si(peaks.bytes_per_s, "GB/s"), "—")
    return table


def roofline_command(measure: bool, *, console: Console | None = None) -> None:
    """Print the running device and its roofs; `measure` (CPU) measures now and caches the result."""
    console = console or Console()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and measure:
        console.print("measuring this CPU (matmul per dtype, streaming read; a few seconds)…")
        peaks = measure_cpu_peaks(dtypes=("fp32", "bf16", "fp16"))
        console.print(f"cached in {cache_path()}")
    elif device.type == "cpu":
        peaks = load_cpu_peaks() or detect(device)
    else:
        peaks = detect(device)
    console.print(_roofs_table(peaks))
    console.print(f"source: {peaks.source}")
    problem = missing_peaks_message(peaks, "fp32" if device.type == "cpu" else "bf16")
    if problem:
        console.print(f"[yellow]{problem}[/yellow]")
    if device.type != "cpu":
        return
    console.print(f"[dim]known accelerators: {', '.join(s.name for s in PEAKS_TABLE)}[/dim]")


def _g(value: float | None) -> str:
    """A rate in G-units to 3 significant figures (narrow columns): 95.1, 1.23e3 → 1,230, None → —."""
    if value is None:
        return "—"
    v = value / 1e9
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _mem(value: int | None) -> str:
    if value is None:
        return "—"
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value} B"


# (header at full width, header when narrow, justify); the narrow headers are explained by NARROW_LEGEND
_COLUMNS = (("phase", "phase", "left"), ("time share", "share", "right"), ("seconds", "s", "right"),
            ("GFLOP/s", "GFLOP/s", "right"), ("GB/s", "GB/s", "right"), ("FLOP/B", "F/B", "right"),
            ("% compute roof", "%C", "right"), ("% bandwidth roof", "%B", "right"), ("verdict", "verdict", "left"),
            ("busy", "busy", "right"), ("peak memory", "mem", "right"))
NARROW_LEGEND = ("share = time share · s = seconds · F/B = FLOP per byte · %C / %B = % of the compute / "
                 "bandwidth roof · mem = peak memory during the phase (RSS on a CPU, allocated on CUDA)")
WIDE = 120  # columns from which the table spells its headers out


def phases_command(run_dir: Path, *, console: Console | None = None) -> None:
    """Print the per-phase roofline table of each stage of a run, and its cycle gap.

    Every percentage is against the roofs as revised (`revision.revise`): a rate a phase achieved above
    the recorded roof lifts it, and the lift is printed. Below 120 columns the headers are abbreviated,
    with a legend."""
    console = console or Console()
    run_dir = Path(run_dir)
    phases_path, device_path = run_dir / "phases.jsonl", run_dir / "device.json"
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist; expected a folder written by "
                                "`posttrain run` (runs/<name>/)")
    if not phases_path.is_file():
        raise FileNotFoundError(f"{phases_path} not found: this run recorded no phases "
                                "(was it started with telemetry, and did a stage reach its first step?)")
    records = read_phases(phases_path)
    device: dict = {}
    if device_path.is_file():
        device = json.loads(device_path.read_text())
        peaks, dtype = Peaks.from_json(device), device.get("dtype", "fp32")
    else:
        peaks, dtype = Peaks(name="unknown (no device.json)", kind="?"), "fp32"
    peaks, late = revise(peaks, dtype, records)
    revisions = net(recorded(device) + late)
    peak_flops, peak_bw = peaks.flops_for(dtype), peaks.bytes_per_s
    console.print(f"[bold]{run_dir}[/bold] — {peaks.name}, {dtype}: compute roof "
                  f"{_si(peak_flops, 'GFLOP/s')}, bandwidth roof {_si(peak_bw, 'GB/s')}")
    for r in revisions:
        console.print(f"[yellow]roof revised: {r.sentence()}[/yellow]")
    problem = missing_peaks_message(peaks, dtype)
    if problem:
        console.print(f"[yellow]{problem}[/yellow]")
    if not records:
        console.print("no phase records yet")
        return

    wide = console.width >= WIDE
    mem: dict[tuple[str, str], int] = {}
    for r in records:
        if r.mem_peak is not None:
            mem[(r.stage, r.name)] = max(mem.get((r.stage, r.name), 0), r.mem_peak)
    for stage, g in gaps_by_stage(records, peak_flops=peak_flops, peak_bytes_per_s=peak_bw).items():
        table = Table(title=f"stage {stage}: {g.cycles} step(s), {g.seconds:.2f} s in phases",
                      box=box.SIMPLE_HEAD if not wide else box.HEAVY_HEAD, padding=(0, 1) if wide else (0, 0),
                      pad_edge=wide, collapse_padding=not wide)
        for full, short, just in _COLUMNS:
            table.add_column(full if wide else short, justify=just, no_wrap=True)  # type: ignore[arg-type]
        for s in g.phases:
            p = place(s.flops, s.bytes, s.seconds, peak_flops=peak_flops, peak_bytes_per_s=peak_bw)
            table.add_row(s.name, _frac(s.share), f"{s.seconds:.3f}", _g(p.flops_per_s), _g(p.bytes_per_s),
                          "—" if p.intensity is None else f"{p.intensity:.3g}",
                          _pct(p.pct_compute_roof), _pct(p.pct_bandwidth_roof), p.bound.value, _frac(s.busy),
                          _mem(mem.get((stage, s.name))))
        console.print(table)
        console.print(f"cycle: achieved {_frac(g.utilization)} of the compute roof (time-weighted), "
                      f"{_frac(g.efficiency)} of each phase's own roof — busy line reads {_frac(g.busy)}")
        if g.projections:
            proj = Table(title=f"projection at other rollout:update ratios (measured {g.rollout_update_ratio:.1f}:1)")
            for col in ("rollout:update", "% compute roof", "busy"):
                proj.add_column(col, justify="right")
            for p in g.projections:
                proj.add_row(f"{p.ratio:g}:1", _frac(p.utilization), _frac(p.busy))
            console.print(proj)
        split = worker_split(stage, [r for r in records if r.stage == stage])
        if split is not None:
            console.print(split)
    if not wide:
        console.print(f"[dim]{NARROW_LEGEND}[/dim]")


def worker_split(stage: str, records: list[PhaseRecord]) -> Table | None:
    """The stage's per-worker split (`posttrain.telemetry.lanes`): each worker's seconds per phase, busy
    and idle time and busy fraction over the stage's span (first phase start → last end), `eval` left out
    (measurement, run by the main process between stages). None when the stage has no other phase."""
    whole = stage_lanes([r for r in records if r.name != "eval"])
    if whole is None:
        return None
    names = list(dict.fromkeys(n for lane in whole.lanes for n in lane.seconds_by_phase()))
    table = Table(title=f"stage {stage} by worker, over its {whole.seconds:.2f} s span (real start times)")
    for col in ("worker", *names, "busy s", "idle s", "busy"):
        table.add_column(col, justify="left" if col == "worker" else "right", no_wrap=True)
    for lane in whole.lanes:
        by = lane.seconds_by_phase()
        table.add_row(lane.worker, *(f"{by[n]:.3f}" if n in by else "—" for n in names), f"{lane.busy:.3f}",
                      f"{whole.seconds - lane.busy:.3f}", _frac(lane.fraction))
    return table
