"""Side by side: the two arms of the distillation experiment (docs/distillation.md) — each post-training
stage's wall seconds and each arm's graded evals (exact match per level, with standard errors).

    python benchmarks/distill_arms.py runs/r1-distill runs/r1-distill-rl [--teacher runs/r1-distill-teacher]

A stage's wall seconds: from the end of the last phase before it (the previous stage's evals included)
to the end of its own last phase (evals excluded) — its setup (data, encoding, model load) counts, the
between-stage evals do not. Read from phases.jsonl, whose `start` is seconds since the run began.
The stages counted as post-training: every stage but `pretrain` (both arms start from the same
pretrained student).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stage_seconds(run_dir: Path) -> dict[str, float]:
    """Each stage's wall seconds, in run order (see the module docstring)."""
    phases = _jsonl(run_dir / "phases.jsonl")
    order: list[str] = []
    for p in phases:
        if p["stage"] not in order:
            order.append(p["stage"])
    out: dict[str, float] = {}
    for stage in order:
        own = [p["start"] + p["seconds"] for p in phases if p["stage"] == stage and p["name"] != "eval"]
        if not own:
            continue  # a stage of evals alone: the loaded start ("base")
        first = min(p["start"] for p in phases if p["stage"] == stage and p["name"] != "eval")
        before = [p["start"] + p["seconds"] for p in phases if p["start"] + p["seconds"] <= first]
        out[stage] = max(own) - (max(before) if before else 0.0)
    return out


def final_evals(run_dir: Path) -> tuple[str, dict[str, tuple[float, float, int]]]:
    """The last evaluated stage and its graded eval (the arithmetic task's exact match, not the prose
    probe) per level: (value, stderr, n)."""
    rows = [r for r in _jsonl(run_dir / "evals.jsonl") if r["metric"] == "exact_match" and r["eval"] == "arithmetic"]
    last = rows[-1]["stage"]
    return last, {r["level"]: (r["value"], r["stderr"], r["n"]) for r in rows if r["stage"] == last}


def pooled(levels: dict[str, tuple[float, float, int]]) -> tuple[float, float]:
    """Exact match over all eval problems (levels weighted by their n) and its binomial standard error."""
    n = sum(v[2] for v in levels.values())
    p = sum(v[0] * v[2] for v in levels.values()) / n
    return p, math.sqrt(p * (1 - p) / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--teacher", type=Path)
    args = ap.parse_args()
    for run in ([args.teacher] if args.teacher else []) + args.runs:
        secs = stage_seconds(run)
        post = {s: v for s, v in secs.items() if s != "pretrain"}
        stage, levels = final_evals(run)
        p, se = pooled(levels)
        print(f"{run}: post-training {sum(post.values()):.0f} s ({', '.join(f'{s} {v:.0f} s' for s, v in post.items())})"
              + (f"; pretrain {secs['pretrain']:.0f} s" if "pretrain" in secs else ""))
        print(f"  after {stage}: " + "  ".join(f"{lv} {v * 100:.1f} ± {e * 100:.1f} (n={n})" for lv, (v, e, n) in sorted(levels.items()))
              + f"  | all {p * 100:.1f} ± {se * 100:.1f}")


if __name__ == "__main__":
    main()
