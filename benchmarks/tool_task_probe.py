"""What a checkpoint does on the `arithmetic-tools` task beyond its greedy eval: how often it calls the
calculator when sampled, how often a call leads to a right answer, and whether it copies the
expression into a call right when the call is started for it.

    python benchmarks/tool_task_probe.py runs/tools-arithmetic/checkpoints/sft/final [--problems 48] [--temperature 1.0]

Prints, on the first `--problems` held-out problems of each level:
- sampled episodes (T = --temperature, seed 1; ≤ 3 turns of ≤ 48 tokens, the model's context): the share
  that call the tool, accuracy, and accuracy among the episodes with and without a call;
- forced calls (greedy): the prompt followed by `<tool_call>{"name": "calculator", "arguments":
  {"expression": "` — the share of completions that copy the problem's expression exactly and close the call.
Numbers for the shipped recipe: docs/envs.md.
"""

from __future__ import annotations

import argparse

import torch

from posttrain.data import encode_prompt
from posttrain.envs import Budget, run_episodes
from posttrain.models import load_model, load_tokenizer
from posttrain.rollout import SamplingParams, make_engine
from posttrain.tasks.arithmetic_tools import ArithmeticToolsTask, episode_correct
from posttrain.worlds.tool_arithmetic import LongProblem

CALL_PREFIX = '<tool_call>{"name": "calculator", "arguments": {"expression": "'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--problems", type=int, default=48, help="held-out problems per level")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok, model = load_tokenizer(args.checkpoint), load_model(args.checkpoint).eval()
    engine = make_engine("native", model, tok)
    task = ArithmeticToolsTask()
    budget = Budget(max_turns=3, max_tokens=int(model.config.max_position_embeddings), turn_tokens=48)
    prefix = tok(CALL_PREFIX, add_special_tokens=False)["input_ids"]
    print(f"{args.checkpoint}: {args.problems} held-out problems per level")
    for level in task.levels:
        problems = task.eval_problems(level)[: args.problems]
        factory = task.environment()
        run = run_episodes(engine, tok, factory, problems, budget=budget,
                           params=SamplingParams(temperature=args.temperature, seed=1))
        factory.close()
        used = [e.tool_calls > 0 for e in run.episodes]
        ok = [episode_correct(p, e) for p, e in zip(problems, run.episodes)]
        n_used = sum(used)
        with_tool = sum(o for o, u in zip(ok, used) if u) / n_used if n_used else float("nan")
        without = sum(o for o, u in zip(ok, used) if not u) / (len(used) - n_used) if n_used < len(used) else float("nan")
        forced = engine.generate([encode_prompt(p, tok) + prefix for p in problems],
                                 SamplingParams(temperature=0.0, max_new_tokens=24))
        expressions = [LongProblem(tuple(p.meta["operands"]), p.meta["op"]).expression for p in problems]
        copied = sum(t.startswith(e + '"}}</tool_call>') for t, e in zip(forced.texts, expressions)) / len(problems)
        print(f"{level}: sampled T={args.temperature:g}: tool calls {n_used / len(used):.3f}, accuracy "
              f"{sum(ok) / len(ok):.3f} (with a call {with_tool:.3f}, without {without:.3f}); "
              f"forced call, greedy: expression copied {copied:.3f}")


if __name__ == "__main__":
    main()
