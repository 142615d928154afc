"""The greedy episode eval the multi-turn tasks share (`arithmetic-tools`, `code-tools`): each problem
played once at temperature 0 in the task's own environment, per level and pooled — a correctness metric
the task defines and `tool_use` (the share of episodes with at least one tool call)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from posttrain.data.records import Problem
from posttrain.envs import Budget, Episode, run_episodes
from posttrain.rollout import SamplingParams, make_engine
from posttrain.tasks.base import EvalRequest, PhaseFn, Task, TaskError
from posttrain.tasks.evaluate import eval_sets, rate
from posttrain.tasks.records import EvalRecord


@torch.no_grad()
def evaluate_episodes(task: Task, model: Any, tok: Any, request: EvalRequest, *, stage: str, checkpoint: str,
                      phase: PhaseFn | None, metric: str, correct: Callable[[Problem, Episode], bool],
                      turns: int) -> list[EvalRecord]:
    """Greedy episodes of ≤ `turns` turns of ≤ `request.max_new_tokens` each (the model's context in all),
    in batches of `request.batch_size`. Sampled pass@k over episodes is not built: a `k` is an error."""
    if request.k:
        raise TaskError(f"task {task.name!r}: sampled pass@k over episodes is not built; evaluate it greedy (no `k`)")
    sets = eval_sets(task, request)
    engine = make_engine("native", model, tok)
    budget = Budget(max_turns=turns, max_tokens=int(model.config.max_position_embeddings),
                    turn_tokens=request.max_new_tokens)
    factory = task.environment()
    out: list[EvalRecord] = []
    hits_all = used_all = total = 0
    was_training = model.training
    model.eval()
    try:
        for level, problems in sets.items():
            hits = used = 0
            for i in range(0, len(problems), request.batch_size):
                chunk = problems[i: i + request.batch_size]
                run = run_episodes(engine, tok, factory, chunk, budget=budget, params=SamplingParams(temperature=0.0),
                                   phase=lambda name: phase() if phase is not None else nullcontext())
                hits += sum(correct(p, e) for p, e in zip(chunk, run.episodes))
                used += sum(e.tool_calls > 0 for e in run.episodes)
            out.append(rate(stage, checkpoint, task.name, level, metric, hits, len(problems)))
            out.append(rate(stage, checkpoint, task.name, level, "tool_use", used, len(problems)))
            hits_all, used_all, total = hits_all + hits, used_all + used, total + len(problems)
    finally:
        factory.close()
        model.train(was_training)
    if len(sets) > 1:
        out.append(rate(stage, checkpoint, task.name, None, metric, hits_all, total))
        out.append(rate(stage, checkpoint, task.name, None, "tool_use", used_all, total))
    return out
