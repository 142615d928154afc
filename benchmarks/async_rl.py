"""Synchronous vs asynchronous GRPO (max_staleness k = 1, 2) on the arithmetic world: step time, learner
idle time and the gold metric after the same number of samples, side by side (docs/async_rl.md).

    python benchmarks/async_rl.py --start runs/demo/checkpoints/sft/final          # the demo's SFT checkpoint
    python benchmarks/async_rl.py --seeds 0 1 --ks 0 1 2 --steps 100 --threads 1
    python benchmarks/async_rl.py --placement split …   # the rollout engine on a Ray actor (docs/placement.md)

The stage is recipes/rlvr-arithmetic.yaml's GRPO (DAPO loss, G = 8, 16 prompts per step, dynamic sampling
≤ 2 rounds, lr 7e-5) from an SFT checkpoint (`--start`; without it quickstart's pretrain + SFT are run
first, as `benchmarks/grpo_gain.py` does), once per (seed, k), interleaved: seed 0 at k = 0, 1, 2, then
seed 1 …, so a change in the machine's load falls on every arm alike. Every arm trains on the same number
of rollouts (`--steps`; dynamic sampling may generate more groups in one arm than another: printed).

Per run, from its phases.jsonl (the GRPO stage, evals left out):
- s/step: wall from the first phase's start to the last phase's end, over the steps;
- learner idle: the share of that wall the learner (worker "main") spends outside reference/update/sync —
  in the synchronous loop that is the rollout (generate, score) it waits through; asynchronously, its
  waits for the rollout thread;
- rollout idle: the share the rollout worker spends outside generate/score/sync (async only);
and from evals.jsonl the gold metric: greedy exact match on the held-out problems of each level after the
stage, with its binomial standard error.

The rollout thread shares the process — and on this machine its 2 cores — with the learner: the overlap
is what torch's kernels (which release the GIL) allow on those cores, not a second device.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from rich.console import Console

from posttrain.pipeline.run import make_world, run_pipeline
from posttrain.runtime.recipe_file import load_recipe
from posttrain.telemetry.phases import read_phases
from posttrain.telemetry.sinks import read_jsonl_records

RECIPES = Path(__file__).resolve().parents[1] / "posttrain" / "recipes"
LEARNER = ("reference", "update", "sync")
ROLLOUT = ("generate", "score", "sync")


def measure(run_dir: Path, steps: int) -> dict[str, float]:
    """s/step, idle shares and generated groups of one run's GRPO stage (see the module docstring)."""
    work = [p for p in read_phases(run_dir / "phases.jsonl") if p.stage == "grpo" and p.name != "eval"]
    wall = max(p.start + p.seconds for p in work) - min(p.start for p in work)
    busy = lambda worker, names: sum(p.seconds for p in work if p.worker == worker and p.name in names)  # noqa: E731
    out = {"wall_s": wall, "s_per_step": wall / steps, "learner_idle": 1 - busy("main", LEARNER) / wall}
    for worker in ("main", "rollout0"):  # the weight move: the learner's snapshot copy, the engine's load
        syncs = [p for p in work if p.worker == worker and p.name == "sync" and p.bytes > 0]
        if syncs:
            out[f"sync_{worker}_ms"] = 1e3 * sum(p.seconds for p in syncs) / len(syncs)
            out[f"sync_{worker}_mb"] = sum(p.bytes for p in syncs) / len(syncs) / 1e6
    if any(p.worker == "rollout0" for p in work):
        out["rollout_idle"] = 1 - busy("rollout0", ROLLOUT) / wall
    recs = [r for _, r in read_jsonl_records(run_dir / "metrics.jsonl") if r.get("stage") == "grpo"]
    out["generated_groups_logged"] = sum(r.get("dynamic/generated_groups", 0.0) for r in recs)
    return out


def gold(run_dir: Path) -> dict[str, tuple[float, float, int]]:
    """Greedy exact match per level after the GRPO stage: (value, stderr, n)."""
    rows = [r for _, r in read_jsonl_records(run_dir / "evals.jsonl") if r.get("stage") == "grpo"
            and r.get("metric") == "exact_match"]
    return {r["level"]: (r["value"], r["stderr"], r["n"]) for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/async-rl"))
    ap.add_argument("--start", type=Path, default=None, help="SFT checkpoint (default: run quickstart's pretrain + SFT)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--levels", nargs="+", default=["L2", "L3", "L4"], help="eval levels (the gold metric)")
    ap.add_argument("--per-level", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--measure-only", action="store_true", help="re-read the run folders under --out, run nothing")
    ap.add_argument("--placement", choices=["local", "split"], default="local",
                    help="split: the rollout engine on one Ray actor (its own process), the learner here (docs/placement.md)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    transformers.utils.logging.disable_progress_bar()
    console = Console()

    start = a.start
    if a.measure_only:
        results = [{"seed": seed, "k": k, **measure(a.out / f"seed{seed}-k{k}", a.steps), "gold": gold(a.out / f"seed{seed}-k{k}")}
                   for seed in a.seeds for k in a.ks if (a.out / f"seed{seed}-k{k}" / "evals.jsonl").exists()]
        return table(console, a, start, results)
    if start is None:  # quickstart's pretrain + SFT, the demo's (as benchmarks/grpo_gain.py)
        quick = load_recipe(RECIPES / "quickstart.yaml", [f"threads={a.threads}"])
        sft = quick.model_copy(update={"name": "async-sft", "stages": quick.stages[:2]})
        run_pipeline(sft, a.out / "sft", fresh=True, console=console, world=make_world(sft))
        start = a.out / "sft" / "checkpoints" / "sft" / "final"

    results = []
    for seed in a.seeds:
        for k in a.ks:  # interleaved: every arm of a seed back to back
            over = [f"model.init={start}", f"seed={seed}", f"threads={a.threads}", f"stages.0.steps={a.steps}",
                    f"stages.0.max_staleness={k}", f"stages.0.save_every={a.steps}",
                    f"evals.0.levels={json.dumps(a.levels)}", f"evals.0.per_level={a.per_level}"]
            if a.placement == "split":
                over.append('placement={"mode": "split", "rollout_workers": 1}')
            rl = load_recipe(RECIPES / "rlvr-arithmetic.yaml", over)
            run_dir = a.out / f"seed{seed}-k{k}"
            t0 = time.perf_counter()
            run_pipeline(rl, run_dir, fresh=True, console=console)
            row = {"seed": seed, "k": k, "run_s": time.perf_counter() - t0, **measure(run_dir, a.steps),
                   "gold": gold(run_dir)}
            results.append(row)
            (a.out / "results.json").write_text(json.dumps(results, indent=1))
            console.print(row)
    table(console, a, start, results)


def table(console: Console, a: argparse.Namespace, start: Path | None, results: list[dict]) -> None:
    console.rule(f"sync vs async GRPO, {a.steps} steps, {a.threads} thread(s), start {start}")
    head = ("| seed | k | s/step | learner idle | rollout idle | sync: learner copy / engine load (ms, MB) | "
            + " | ".join(f"{lv} exact match ± SE" for lv in a.levels) + " |")
    console.print(head, soft_wrap=True)
    console.print("|" + "---|" * (6 + len(a.levels)), soft_wrap=True)
    for r in results:
        cells = [f"{100 * r['gold'][lv][0]:.1f} ± {100 * r['gold'][lv][1]:.1f}" if lv in r["gold"] else "—" for lv in a.levels]
        sync = " / ".join(f"{r[f'sync_{w}_ms']:.1f}" for w in ("main", "rollout0") if f"sync_{w}_ms" in r)
        mb = r.get("sync_main_mb", r.get("sync_rollout0_mb"))
        console.print(f"| {r['seed']} | {r['k']} | {r['s_per_step']:.2f} | {100 * r['learner_idle']:.0f}% | "
                      + (f"{100 * r['rollout_idle']:.0f}%" if "rollout_idle" in r else "—")
                      + f" | {sync or '—'}" + (f" ({mb:.1f} MB)" if mb else "") + " | " + " | ".join(cells) + " |",
                      soft_wrap=True)
    console.print(f"written: {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
