"""GRPO on a real pretrained chat model over a user's problem file: SmolLM2-135M-Instruct, 2-digit additions.

    python benchmarks/smollm2_grpo.py [--steps 8] [--prompts 4] [--group 4] [--lr 1e-6] [--heldout 200]
        [--threads 2] [--out runs/smollm2-grpo] [--init CHECKPOINT]

By default GRPO starts from the base SmolLM2-135M-Instruct. `--init` starts it from another checkpoint
folder instead — e.g. `runs/smollm2/checkpoints/sft/final`, the SFT stage of
`recipes/smollm2-own-data.yaml` (the pipeline's own order: SFT, then RL). The held-out problems share no
(a, b) pair with that recipe's files (they come from the same seeded shuffle: its files take pairs
0–599, this benchmark's train file 0–1,999 and its held-out file 2,000 onward).

1. Writes the user's files in our `problem` schema (docs/data.md): `train.jsonl` (2,000 problems) and
   `heldout.jsonl` (200 others, no (a, b) pair shared), each "Compute A + B. Reply with the number only."
   with its `answer`.
2. Greedy accuracy of the start model on the held-out file, three ways: **strict** (the reply is the
   number, what the prompt asks), **lenient** (the reply's last integer is the answer; SmolLM2's habit
   is `12 + 7 = 19`), and the **`math` verifier**'s score (what the GRPO reward sees).
3. GRPO through the pipeline (`run_pipeline` with a `Recipe` whose `model.init` is the SmolLM2 folder
   and whose GRPO data is `train.jsonl`), full fine-tuning at a low lr, the `math` verifier as reward.
   The recipe names no between-stage evals (the held-out accuracies here are this benchmark's measure).
4. The same three accuracies after, the change with its paired standard error, the wall time of the
   stage, and how many groups had zero reward variance (advantage 0 for every sample: no signal).
Whatever the numbers are, they are printed plainly.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console

from posttrain.data import encode_prompt
from posttrain.models import load_model, load_tokenizer, smollm2_135m_instruct
from posttrain.pipeline.run import run_pipeline
from posttrain.rewards import MathVerifier
from posttrain.rollout.greedy import greedy
from posttrain.runtime.config import Recipe

PROMPT = "Compute {a} + {b}. Reply with the number only."
_INT = re.compile(r"-?\d+")


def write_problems(folder: Path, n_train: int = 2000, n_heldout: int = 200, seed: int = 0) -> tuple[Path, Path]:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, chunk in (("train", pairs[:n_train]), ("heldout", pairs[n_train: n_train + n_heldout])):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b),
                                            "level": "2-digit add"}) + "\n" for a, b in chunk))
        paths.append(path)
    return paths[0], paths[1]


def accuracies(folder: Path, heldout: Path, threads: int) -> dict[str, list[float]]:
    """Per-problem 0/1 scores of greedy replies (max 16 new tokens): strict, lenient, math verifier."""
    torch.set_num_threads(threads)
    model, tok = load_model(folder).eval(), load_tokenizer(folder)
    rows = [json.loads(line) for line in heldout.read_text().splitlines()]
    prompts = [encode_prompt(r["prompt"], tok) for r in rows]
    texts, _ = greedy(model, tok, prompts, 16, 50)
    answers = [r["answer"] for r in rows]
    strict = [float(t.strip().rstrip(".") == a) for t, a in zip(texts, answers)]
    lenient = [float(bool(m := _INT.findall(t)) and m[-1] == a) for t, a in zip(texts, answers)]
    with MathVerifier() as judge:
        verifier = [float(v or 0.0) for v in judge(texts, answer=answers)]
    return {"strict": strict, "lenient": lenient, "math verifier": verifier, "examples": texts[:3]}


def stderr(xs: list[float]) -> float:
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--heldout", type=int, default=200, help="held-out problems")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/smollm2-grpo"))
    ap.add_argument("--init", type=Path, default=None,
                    help="checkpoint folder GRPO starts from (default: the base SmolLM2-135M-Instruct)")
    args = ap.parse_args()

    start = args.init or smollm2_135m_instruct()
    train, heldout = write_problems(args.out.parent / f"{args.out.name}-data", n_heldout=args.heldout)
    before = accuracies(start, heldout, args.threads)
    print("before:", {k: f"{statistics.mean(v):.1%}" for k, v in before.items() if k != "examples"},
          "e.g.", before["examples"])

    recipe = Recipe.model_validate({
        "name": args.out.name, "seed": 0, "threads": args.threads,
        "model": {"init": str(start)},
        "stages": [{"stage": "grpo", "steps": args.steps, "batch_size": args.prompts * args.group,
                    "group_size": args.group, "max_new_tokens": 16, "max_prompt_len": 64, "temperature": 1.0,
                    "optim": {"lr": args.lr, "warmup_steps": 0, "min_lr_ratio": 1.0},
                    "data": [{"path": str(train)}], "rewards": [{"name": "math"}],
                    "save_every": args.steps, "log_every": 1, "eval_problems": 1}],
    })
    t0 = time.perf_counter()
    run_pipeline(recipe, args.out, fresh=True, console=Console(quiet=True))
    wall = time.perf_counter() - t0
    stage_s = sum(json.loads(line)["seconds"] for line in (args.out / "phases.jsonl").read_text().splitlines()
                  if json.loads(line).get("stage") == "grpo")
    metrics = [json.loads(line) for line in (args.out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m.get("stage") == "grpo" and "groups/zero_variance_frac" in m]
    zero = sum(round(m["groups/zero_variance_frac"] * m["dynamic/generated_groups"]) for m in steps)
    groups = sum(round(m["dynamic/generated_groups"]) for m in steps)
    rewards = [m.get("reward/total", float("nan")) for m in steps]

    after = accuracies(args.out / "checkpoints" / "grpo" / "final", heldout, args.threads)
    print("after: ", {k: f"{statistics.mean(v):.1%}" for k, v in after.items() if k != "examples"},
          "e.g.", after["examples"])
    n = len(before["strict"])
    print(f"\n{'SmolLM2-135M-Instruct' if args.init is None else args.init}, GRPO {args.steps} steps × {args.prompts} prompts × G={args.group}, "
          f"lr {args.lr:g}, full fine-tuning, reward = math verifier; held-out n = {n}, greedy:")
    for key in ("strict", "lenient", "math verifier"):
        b, a = before[key], after[key]
        diff = [y - x for x, y in zip(b, a)]
        print(f"  {key:14s} before {statistics.mean(b):6.1%} ± {stderr(b):.1%}   after {statistics.mean(a):6.1%} ± "
              f"{stderr(a):.1%}   change {statistics.mean(diff):+.1%} ± {stderr(diff):.1%} (paired)")
    print(f"  zero-variance groups: {zero} of {groups} (no learning signal from those)")
    print(f"  mean reward per step: {[round(r, 3) for r in rewards]}")
    print(f"  wall time: pipeline {wall:.0f} s (GRPO stage phases {stage_s:.0f} s), threads {args.threads}")


if __name__ == "__main__":
    main()
