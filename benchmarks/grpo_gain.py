"""RLVR gain, measured: quickstart's pretrain + SFT, then recipes/rlvr-arithmetic.yaml's GRPO stage.

    python benchmarks/grpo_gain.py                       # ≈ 7 minutes on 2 cores
    python benchmarks/grpo_gain.py --out runs/gain --seed 1

1. Pretrain + SFT exactly as `posttrain demo` does (recipes/quickstart.yaml's first two stages, the
   same world), through the pipeline, with a world instance that records every problem a training
   split drew (`ArithmeticWorld.drawn`).
2. GRPO from that SFT checkpoint with recipes/rlvr-arithmetic.yaml (`model.init` set to it): its
   world holds 1,000 problems per sampled level out of the GRPO problems, and the pipeline evaluates
   the start ("base") and the result ("grpo") into evals.jsonl.
3. The eval set, decontaminated: the held-out problems of each level minus any the pretrain/SFT
   data drew (step 1 can have seen some of the problems beyond the world's default 200). Greedy
   exact match per problem before and after; the gain, its paired standard error
   (sd of the per-problem differences / √n) and the binomial standard error of the eval set
   (√(p(1−p)/n) at the after-score), and the GRPO stage's wall time.

Targets (issue 7): ≥ +10 points on a level where SFT starts between 20% and 70%, more than 3 standard
errors of the eval set, GRPO within 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import transformers
from rich.console import Console

from posttrain.data import encode_prompt as enc
from posttrain.models import load_model, load_tokenizer
from posttrain.runtime.recipe_file import load_recipe
from posttrain.rollout.greedy import greedy
from posttrain.pipeline.run import make_world, run_pipeline
from posttrain.telemetry.phases import read_phases
from posttrain.worlds.arithmetic import ArithmeticWorld, Fact, parse_answer

RECIPES = Path(__file__).resolve().parents[1] / "posttrain" / "recipes"


def correct(model_dir: Path, problems: list[dict], max_new: int) -> list[bool]:
    """Greedy exact match per problem."""
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    texts, reasons = greedy(model, tok, [enc(p["prompt"], tok) for p in problems], max_new, 128)
    return [r == "stop" and parse_answer(t) == int(p["answer"]) for t, r, p in zip(texts, reasons, problems)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/grpo-gain"))
    ap.add_argument("--seed", type=int, default=0, help="recipe seed of both runs (0 = the demo's)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    transformers.utils.logging.disable_progress_bar()
    console = Console()

    # 1. pretrain + SFT, the demo's
    quick = load_recipe(RECIPES / "quickstart.yaml", [f"seed={a.seed}", f"threads={a.threads}"])
    sft_recipe = quick.model_copy(update={"name": "gain-sft", "stages": quick.stages[:2]})
    sft_world = make_world(sft_recipe)
    sft_dir = a.out / "sft"
    run_pipeline(sft_recipe, sft_dir, fresh=True, console=console, world=sft_world)
    start = sft_dir / "checkpoints" / "sft" / "final"

    # 2. GRPO from it
    rl = load_recipe(RECIPES / "rlvr-arithmetic.yaml", [f"model.init={start}", f"seed={a.seed}", f"threads={a.threads}"])
    rl_dir = a.out / "grpo"
    t0 = time.perf_counter()
    run_pipeline(rl, rl_dir, fresh=True, console=console)
    total = time.perf_counter() - t0
    work = [p for p in read_phases(rl_dir / "phases.jsonl") if p.stage == "grpo" and p.name != "eval"]
    stage_s = max(p.start + p.seconds for p in work) - min(p.start for p in work)  # first rollout → last update
    end = rl_dir / "checkpoints" / "grpo" / "final"

    # 3. decontaminated eval, paired
    world: ArithmeticWorld = make_world(rl)
    seen: set[Fact] = sft_world.drawn
    console.rule("GRPO gain, greedy exact match on held-out problems")
    console.print(f"GRPO stage ({rl.stages[0].steps} steps): {stage_s:.0f} s of rollouts and updates; "
                  f"run with before/after evals {total:.0f} s; {a.threads} threads; seed {a.seed}")
    rows = []
    spec = rl.evals[0]  # {task: arithmetic, levels: …, per_level: 1000}
    for level in spec.levels or ["L1", "L2", "L3", "L4"]:
        problems = world.eval_problems(level)[: spec.per_level_or_default]
        clean = [p for p in problems if Fact(p["a"], p["op"], p["b"]) not in seen]
        before = correct(start, clean, spec.max_new_tokens)
        after = correct(end, clean, spec.max_new_tokens)
        n = len(clean)
        d = [int(y) - int(x) for x, y in zip(before, after)]
        p0, p1 = sum(before) / n, sum(after) / n
        gain = p1 - p0
        paired = statistics.stdev(d) / math.sqrt(n) if n > 1 else float("nan")
        binom = math.sqrt(p1 * (1 - p1) / n)
        rows.append({"level": level, "n": n, "dropped_seen": len(problems) - n, "before": p0, "after": p1,
                     "gain": gain, "se_paired": paired, "se_eval": binom})
        console.print(f"  {level}: n={n} ({len(problems) - n} seen in pretrain/SFT data, dropped)  "
                      f"{100 * p0:5.1f}% → {100 * p1:5.1f}%  gain {100 * gain:+5.1f} points  "
                      f"= {gain / paired if paired else float('nan'):4.1f} paired SE ({100 * paired:.2f}), "
                      f"{gain / binom if binom else float('nan'):4.1f} eval-set SE ({100 * binom:.2f})")
    (a.out / "gain.json").write_text(json.dumps({"seed": a.seed, "threads": a.threads, "grpo_stage_s": stage_s,
                                                 "grpo_run_s": total, "levels": rows}, indent=1))
    console.print(f"written: {a.out / 'gain.json'}")


if __name__ == "__main__":
    main()
