"""What benchmarks/gpu_check.sh reports, from the run folders it made: one table per arm and the ratio.

    python benchmarks/gpu/summarize.py OUT_DIR RUN_SYNC [RUN_ASYNC]

Writes OUT_DIR/summary.json and OUT_DIR/summary.md, and prints the markdown. Every number is read from
a run folder (metrics.jsonl, phases.jsonl, device.json) — nothing is computed that the run did not record:
- step time: the median of `train/seconds_per_rollout` over the steps after the first (the first holds
  vLLM's and the allocator's warm-up);
- per phase, pooled over the stage (`posttrain.report.summaries.phase_rows`, the roofs as revised):
  seconds, time share, % of the compute roof, % of the bandwidth roof, verdict, busy —
  MBU of generate is generate's % of the bandwidth roof, MFU of update is update's % of the compute roof;
- the busy line: `telemetry/busy`, the mean over the logged steps;
- sync: bytes pushed per sync (the phase's declared bytes) and seconds per sync;
- the sampler/learner log-prob mismatch: the mean over steps of every metric whose name says it
  (`clip/approx_kl` — with μ = 1 the ratio is learner over sampler log-probs on the same samples —
  `clip/ratio_max`, and any key holding "mismatch", "offpolicy", "importance", "tis" or "staleness": the
  asynchronous GRPO logs `mismatch/kl`, `mismatch/logprob_abs_mean` and `offpolicy/…` in every run);
- per worker (posttrain.telemetry.lanes): busy fraction over the stage's span;
- the async/sync ratio of the median step times.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from posttrain.report.run_data import load_run
from posttrain.report.summaries import phase_rows
from posttrain.telemetry.lanes import stage_lanes

MISMATCH = re.compile(r"approx_kl|ratio_max|mismatch|offpolicy|importance|(^|/)tis|staleness")
STAGE = "grpo"


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def arm(run_dir: Path) -> dict[str, Any]:
    """The numbers of one run folder (module docstring)."""
    run = load_run(run_dir)
    metrics = run.stage_metrics(STAGE)
    records = [r for r in run.stage_phases(STAGE) if r.name != "eval"]
    rows, _ = phase_rows(records, peak_flops=run.peak_flops, peak_bytes_per_s=run.peak_bytes_per_s)
    steps = [m for m in metrics if isinstance(m.get("train/seconds_per_rollout"), (int, float))]
    later = [m["train/seconds_per_rollout"] for m in steps[1:]] or [m["train/seconds_per_rollout"] for m in steps]
    phases = {r.name: {"seconds": r.seconds, "share": r.share, "pct_compute_roof": r.pct_compute_roof,
                       "pct_bandwidth_roof": r.pct_bandwidth_roof, "bound": r.bound, "busy": r.busy,
                       "occurrences": r.occurrences} for r in rows}
    syncs = [r for r in records if r.name == "sync"]
    mismatch: dict[str, float] = {}
    for key in sorted({k for m in metrics for k in m if MISMATCH.search(k)}):
        vals = [float(m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
        if vals:
            mismatch[key] = statistics.fmean(vals)
    lanes = stage_lanes(records)
    return {
        "run_dir": str(run_dir), "device": run.peaks.name, "dtype": run.dtype, "steps": len(metrics),
        "step_seconds_median": statistics.median(later) if later else None,
        "phases": phases,
        "mbu_generate_pct": phases.get("generate", {}).get("pct_bandwidth_roof"),
        "mfu_update_pct": phases.get("update", {}).get("pct_compute_roof"),
        "busy_line": _mean([float(m["telemetry/busy"]) for m in metrics if isinstance(m.get("telemetry/busy"), (int, float))]),
        "sync_bytes": _mean([r.bytes for r in syncs]), "sync_seconds": _mean([r.seconds for r in syncs]),
        "mismatch": mismatch,
        "workers": {lane.worker: lane.fraction for lane in lanes.lanes} if lanes else {},
        "reward": _mean([float(m["reward/total"]) for m in metrics if isinstance(m.get("reward/total"), (int, float))]),
    }


def _f(x: float | None, fmt: str = "{:.3g}") -> str:
    return "—" if x is None else fmt.format(x)


def markdown(arms: dict[str, dict[str, Any]], ratio: float | None) -> str:
    lines = []
    for name, a in arms.items():
        lines += [f"## {name} — {a['run_dir']} ({a['device']}, {a['dtype']}, {a['steps']} logged steps)", "",
                  "| phase | seconds | share | % compute roof | % bandwidth roof | verdict | busy |",
                  "|---|---|---|---|---|---|---|"]
        for p, r in a["phases"].items():
            lines.append(f"| {p} | {r['seconds']:.3f} | {100 * r['share']:.1f}% | {_f(r['pct_compute_roof'], '{:.2f}')} | "
                         f"{_f(r['pct_bandwidth_roof'], '{:.2f}')} | {r['bound']} | "
                         f"{_f(None if r['busy'] is None else 100 * r['busy'], '{:.0f}%')} |")
        lines += ["", f"- step time (median after the first): {_f(a['step_seconds_median'])} s",
                  f"- MBU of generate: {_f(a['mbu_generate_pct'], '{:.2f}')}% · MFU of update: {_f(a['mfu_update_pct'], '{:.2f}')}%",
                  f"- busy line (mean of telemetry/busy): {_f(None if a['busy_line'] is None else 100 * a['busy_line'], '{:.0f}%')}",
                  f"- sync: {_f(a['sync_bytes'], '{:,.0f}')} bytes and {_f(a['sync_seconds'], '{:.4f}')} s per sync",
                  "- sampler/learner mismatch (means over steps): "
                  + (", ".join(f"{k} {v:.4g}" for k, v in a["mismatch"].items()) or "no such metric logged"),
                  "- busy fraction per worker over the stage: "
                  + (", ".join(f"{w} {100 * f:.0f}%" for w, f in a["workers"].items()) or "—"),
                  f"- mean reward: {_f(a['reward'])}", ""]
    lines.append(f"**async/sync step-time ratio: {_f(ratio, '{:.3f}')}**" if ratio is not None else
                 "async/sync step-time ratio: — (no async arm ran)")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    out = Path(argv[0])
    arms = {name: arm(Path(d)) for name, d in zip(("sync", "async"), argv[1:]) if (Path(d) / "metrics.jsonl").is_file()}
    missing = [d for d in argv[1:] if not (Path(d) / "metrics.jsonl").is_file()]
    for d in missing:
        print(f"{d}: no metrics.jsonl — that arm did not reach a logged step (see its log)")
    s, a = arms.get("sync", {}).get("step_seconds_median"), arms.get("async", {}).get("step_seconds_median")
    ratio = a / s if a is not None and s else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"arms": arms, "async_over_sync": ratio}, indent=2) + "\n")
    text = markdown(arms, ratio)
    (out / "summary.md").write_text(text)
    print(text)
    return 0 if arms else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
