"""GRPO step time: a multi-turn episode batch vs the same number of single-turn samples, on the split bar.

    python benchmarks/episodes_step_time.py                 # 16 sequences (4 problems × G 4), 4 steps each
    python benchmarks/episodes_step_time.py --steps 6 --threads 2
    python benchmarks/episodes_step_time.py --kv both --repeats 3 --turns 4  # KV kept vs not, interleaved

Same tiny-1m policy (random init; `--model` names another tiny preset), same problems, same reward (the share of digits in the reply), same
16 samples per step and the same budget of model tokens per sample (2 × `--turn-tokens` single-turn;
two turns of `--turn-tokens` as episodes). Three runs, one after the other:
- single: one completion per sample;
- episodes: two turns, the environment's answer a fixed tool message (an instant environment);
- episodes+python: two turns, the first answered by a real Python program run in the bubblewrap
  sandbox (the tool a code task would call), so the `tool` phase holds real tool time.
Prints each run's seconds per step by phase (telemetry's phases.jsonl) and the ratio to single-turn.

`--kv`: the episode runs keep each episode's KV cache across turns (`kept`, the default: `env.keep_kv`),
prefill every turn from scratch (`off`), or `both`: each episode run twice, off then kept, repeated
`--repeats` times in that interleaved order (so a change in the shared host's load falls on both), and
reported as means with the prompt and prefill-saved tokens per step (`episode/prompt_tokens`,
`episode/prefill_tokens_saved`). `--turns`: turns per episode (the environment answers every turn but
the last with the same tool message); single-turn samples get `turns × --turn-tokens` tokens.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from posttrain.data.records import Message
from posttrain.envs import EnvironmentFactory, PythonTool, StepResult, format_call, parse_tool_calls, run_calls
from posttrain.models import build_tiny, train_tokenizer
from posttrain.rewards import WeightedVerifier
from posttrain.runtime.config import GRPOStage, Recipe
from posttrain.runtime.context import RunContext
from posttrain.stages import grpo as grpo_mod
from posttrain.tasks import TaskSet
from posttrain.tasks.arithmetic import ArithmeticTask
from posttrain.telemetry import Telemetry, read_phases
from posttrain.worlds.arithmetic import ArithmeticWorld

PHASES = ("generate", "tool", "score", "update", "sync")


def digits(completions: list[str], **_) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


class Turns:
    def __init__(self, python: PythonTool | None, turns: int = 2):
        self.k, self.python, self.turns = 0, python, turns

    def reset(self, problem):
        return [Message("user", problem.prompt)]

    def step(self, text):
        self.k += 1
        if self.k >= self.turns:
            return StepResult([], None, done=True)
        if self.python is None or self.k > 1:  # Python on the first turn only
            return StepResult([Message("tool", "12 + 30 = 42")], None, done=False, tool_calls=1)
        (r,) = run_calls(parse_tool_calls(format_call("python", {"code": "print(12 + 30)"})), {"python": self.python})
        return StepResult([Message("tool", r.content)], None, done=False, tool_calls=1, tool_errors=int(r.error))


def run(kind: str, a, policy: Path, tokenizer, world, keep_kv: bool = True) -> dict[str, float]:
    python = PythonTool(concurrency=2) if kind == "episodes+python" else None
    grpo_mod.build_rewards = lambda specs: [WeightedVerifier("digits", digits)]
    grpo_mod.build_env = lambda ctx, spec, data: EnvironmentFactory(lambda: Turns(python, a.turns), [python] if python else [])
    env = None if kind == "single" else {"name": "tools", "max_turns": a.turns, "keep_kv": keep_kv,
                                         "max_tokens": 150 + 40 * (a.turns - 2)}
    cfg = GRPOStage(steps=a.steps, batch_size=16, group_size=4, log_every=1, save_every=a.steps, loss="dapo",
                    eval_every=0, data=[{"task": "arithmetic", "n": 200}], env=env,
                    max_new_tokens=a.turn_tokens * (a.turns if env is None else 1),
                    optim={"lr": 1e-3, "warmup_steps": 0, "min_lr_ratio": 1.0})
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d)
        recipe = Recipe(stages=[cfg], threads=a.threads, evals=[{"task": "arithmetic", "levels": ["L2"]}])
        ctx = RunContext(run_dir=run_dir, recipe=recipe, device=torch.device("cpu"), tokenizer=tokenizer,
                         tasks=TaskSet.of(ArithmeticTask(world=world)), telemetry=Telemetry.open(run_dir, busy=False),
                         sink=(sink := _Capture()), start=policy)
        grpo_mod.run_grpo(cfg, ctx)
        ctx.telemetry.close()
        recs = [r for r in read_phases(run_dir / "phases.jsonl") if r.stage == "grpo" and r.step > 1]  # step 1: warm-up
    per = defaultdict(float)
    for r in recs:
        per[r.name] += r.seconds / (a.steps - 1)
    for key in ("episode/prompt_tokens", "episode/prefill_tokens_saved"):  # per step, mean of steps 2 …
        per[key] = sum(r.get(key, 0.0) for r in sink.records if r.get("step", 0) > 1) / (a.steps - 1)
    return dict(per)


class _Capture:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--turns", type=int, default=2, help="turns per episode")
    ap.add_argument("--kv", choices=("kept", "off", "both"), default="kept",
                    help="episodes keep the KV cache across turns, or not, or both interleaved")
    ap.add_argument("--repeats", type=int, default=1, help="with --kv both: off/kept pairs, interleaved")
    ap.add_argument("--model", default="tiny-1m", help="the tiny preset of the policy (random init)")
    ap.add_argument("--runs", default="single,episodes,episodes+python", help="comma-separated runs")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    world = ArithmeticWorld(seed=0)
    rng = random.Random(0)
    texts = list(world.pretrain_documents(400)) + [f"{rng.randint(0, 99)} + {rng.randint(0, 99)}" for _ in range(100)]
    tokenizer = train_tokenizer(texts, vocab_size=512)
    with tempfile.TemporaryDirectory() as d:
        policy = Path(d)
        build_tiny(a.model, vocab_size=len(tokenizer), seed=0, max_seq_len=160 + 40 * (a.turns - 2),
                   pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(policy)
        tokenizer.save_pretrained(policy)
        results = measure(a, policy, tokenizer, world)
    base = sum(results["single"].get(p, 0.0) for p in PHASES) if "single" in results else None
    print(f"seconds per step (mean of steps 2–{a.steps}), 16 samples, ≤ {a.turns * a.turn_tokens} model tokens each"
          + (f"; {a.repeats} interleaved off/kept repeats" if a.kv == "both" else ""))
    print(f"{'run':<24}" + "".join(f"{p:>10}" for p in PHASES) + f"{'total':>10}{'× single':>10}"
          f"{'prompt tok':>12}{'saved tok':>11}")
    for kind, per in results.items():
        total = sum(per.get(p, 0.0) for p in PHASES)
        print(f"{kind:<24}" + "".join(f"{per.get(p, 0.0):>10.3f}" for p in PHASES) + f"{total:>10.3f}"
              + (f"{total / base:>10.2f}" if base else f"{'—':>10}")
              + f"{per.get('episode/prompt_tokens', 0.0):>12.0f}{per.get('episode/prefill_tokens_saved', 0.0):>11.0f}")


def measure(a, policy: Path, tokenizer, world) -> dict[str, dict[str, float]]:
    """Each requested run once, or (`--kv both`) each episode run as off/kept pairs, `--repeats` times
    interleaved, averaged."""
    kinds = [k.strip() for k in a.runs.split(",")]
    unknown = set(kinds) - {"single", "episodes", "episodes+python"}
    if unknown:
        raise SystemExit(f"--runs: unknown {sorted(unknown)}; expected single, episodes, episodes+python")
    if a.kv != "both":
        return {k if k == "single" else f"{k} (kv {a.kv})": run(k, a, policy, tokenizer, world, a.kv == "kept")
                for k in kinds}
    sums: dict[str, dict[str, float]] = {}
    for _ in range(a.repeats):
        for k in kinds:
            for keep in ((None,) if k == "single" else (False, True)):
                name = k if keep is None else f"{k} (kv {'kept' if keep else 'off'})"
                got = run(k, a, policy, tokenizer, world, keep is not False)
                acc = sums.setdefault(name, defaultdict(float))
                for key, v in got.items():
                    acc[key] += v / a.repeats
    return {k: dict(v) for k, v in sums.items()}


if __name__ == "__main__":
    main()
