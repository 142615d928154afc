"""The recipes benchmarks/gpu_check.sh runs: a short GRPO, synchronous and asynchronous (`max_staleness: 1`).

    python benchmarks/gpu/recipes.py OUT_DIR --model FOLDER          # on a GPU: SmolLM2, vLLM, bf16
    python benchmarks/gpu/recipes.py OUT_DIR --dry-run               # on a CPU: tiny-1m, native, fp32

Writes OUT_DIR/sync.yaml and, when this posttrain's GRPO stage knows `max_staleness` (asynchronous GRPO,
issue 22 item 3 — another branch), OUT_DIR/async.yaml; prints one line per recipe, or why the async
one was not written. Every recipe is validated by `Recipe.model_validate` before it is written, so a
field this posttrain does not know fails here, naming it, rather than minutes into the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from posttrain.runtime.config import GRPOStage, Recipe

ROOT = Path(__file__).resolve().parents[2]
PROBLEMS = ROOT / "recipes" / "data" / "smollm2" / "problems.jsonl"  # "Compute A + B." with answers: the math verifier


def grpo_recipe(name: str, *, model: str, dry_run: bool, steps: int, staleness: int | None) -> dict[str, Any]:
    """A GRPO-only recipe. GPU: 8 prompts × G = 8 = 64 samples of ≤ 128 tokens a step from SmolLM2-135M
    on vLLM, bf16, colocated (the engine sleeps through each update). Dry run: the same loop on a CPU with
    the native engine, tiny-1m on the arithmetic task, 4 prompts × G = 4 of ≤ 8 tokens, fp32, 1 thread."""
    if dry_run:
        stage: dict[str, Any] = {"stage": "grpo", "steps": steps, "batch_size": 16, "group_size": 4, "max_new_tokens": 8,
                                 "data": [{"task": "arithmetic", "n": 64}], "levels": ["L1"], "backend": "native",
                                 # the reply's length in characters: differs inside every group even for a
                                 # random model, so every step updates (tests/test_distributed.py's choice)
                                 "rewards": [{"name": "length", "params": {"max_len": 200, "count": "chars"}}],
                                 "optim": {"lr": 1e-3, "warmup_steps": 0}}
        top: dict[str, Any] = {"device": "cpu", "dtype": "fp32", "threads": 1,
                               "model": {"init": "tiny-1m", "vocab_size": 400}}
    else:
        stage = {"stage": "grpo", "steps": steps, "batch_size": 64, "group_size": 8, "max_new_tokens": 128,
                 "max_prompt_len": 96, "temperature": 1.0, "data": [{"path": str(PROBLEMS)}],
                 "rewards": [{"name": "math", "weight": 1.0}], "backend": "vllm", "release_rollout_memory": True,
                 "optim": {"lr": 1e-6, "warmup_steps": 1, "min_lr_ratio": 1.0}}
        top = {"device": "cuda", "dtype": "bf16", "model": {"init": model}}
    stage.update(save_every=steps, log_every=1)
    if staleness is not None:
        stage["max_staleness"] = staleness
    return {"name": name, "seed": 0, **top, "telemetry": {"measure_cpu": False}, "stages": [stage]}


def knows_staleness() -> bool:
    return "max_staleness" in GRPOStage.model_fields


def write(out: Path, *, model: str, dry_run: bool, steps: int) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    arms: list[tuple[str, int | None]] = [("sync", None)]
    if knows_staleness():
        arms.append(("async", 1))
    else:
        print("async: not written — this posttrain's GRPO stage has no `max_staleness` field (asynchronous GRPO "
              "is not merged here); the check runs the synchronous arm only")
    for name, staleness in arms:
        recipe = grpo_recipe(f"gpu-check-{name}", model=model, dry_run=dry_run, steps=steps, staleness=staleness)
        Recipe.model_validate(recipe)  # a field this posttrain does not know fails here, by name
        path = out / f"{name}.yaml"
        path.write_text(f"# posttrain run {path} --out runs/gpu-check-{name}   (written by benchmarks/gpu/recipes.py)\n"
                        + yaml.safe_dump(recipe, sort_keys=False))
        print(f"{name}: {path}")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="smollm2-135m-instruct", help="HF folder (or built-in name) GRPO starts from")
    p.add_argument("--dry-run", action="store_true", help="CPU, native engine, tiny-1m")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per arm (default: 8 on a GPU, 3 dry)")
    a = p.parse_args(argv)
    write(a.out, model=a.model, dry_run=a.dry_run, steps=a.steps or (3 if a.dry_run else 8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
