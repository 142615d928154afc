"""The generic held-out eval of a problem task: greedy pass@1 and sampled pass@k, per level.

Rows (EvalRecord): eval `<task>` metric `pass@1` under greedy decoding, per level and pooled (level
None) where the task has more than one level; eval `<task>@T<temperature>` metric `pass@<k>` from
`samples` sampled answers per problem (the unbiased estimator of Chen et al. 2021,
`posttrain.rewards.pass_at_k`), per level and pooled. `n` counts problems; `stderr` is the binomial
standard error of a greedy rate, the standard error across problems of a pass@k. Sampling is seeded:
the same checkpoint gives the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from posttrain.data import encode_prompt
from posttrain.data.records import Problem
from posttrain.rewards.passk import ProblemOutcome, pass_at_k_by_level
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.greedy import greedy
from posttrain.tasks.records import EvalRecord, EvalRequest, PhaseFn, binomial_stderr



class Task(Protocol):
    """What the generic eval reads of a problem task (`base.Task` has it)."""

    name: str
    levels: tuple[str, ...]

    def check_levels(self, levels: Sequence[str]) -> None: ...
    def eval_problems(self, level: str | None) -> list[Problem]: ...
    def judge(self, problems: Sequence[Problem], texts: Sequence[str], finish: Sequence[str]) -> list[bool]: ...


def eval_sets(task: Task, request: EvalRequest) -> dict[str | None, list[Problem]]:
    """Held-out problems per level the request asks for (level None: a task without levels)."""
    levels: Sequence[str | None] = request.levels if request.levels is not None else (task.levels or (None,))
    if request.levels is not None:
        task.check_levels(request.levels)
    return {lv: task.eval_problems(lv)[: request.per_level] for lv in levels}


def rate(stage: str, checkpoint: str, name: str, level: str | None, metric: str, hits: int, n: int) -> EvalRecord:
    p = hits / n if n else float("nan")
    return EvalRecord(stage, checkpoint, name, level, metric, p, n, binomial_stderr(p, n))


def evaluate_problems(task: Task, model: Any, tok: Any, request: EvalRequest, *, stage: str, checkpoint: str,
                      phase: PhaseFn | None = None) -> list[EvalRecord]:
    sets = eval_sets(task, request)
    out: list[EvalRecord] = []
    if request.greedy:
        total = hits_all = 0
        for level, problems in sets.items():
            texts, reasons = greedy(model, tok, [encode_prompt(p, tok) for p in problems], request.max_new_tokens,
                                    request.batch_size, phase)
            hits = sum(task.judge(problems, texts, reasons))
            out.append(rate(stage, checkpoint, task.name, level, "pass@1", hits, len(problems)))
            total, hits_all = total + len(problems), hits_all + hits
        if len(sets) > 1:
            out.append(rate(stage, checkpoint, task.name, None, "pass@1", hits_all, total))
    if request.k:
        out += sampled_pass_at_k(task, model, tok, request, sets, stage=stage, checkpoint=checkpoint, phase=phase)
    return out


def check_ks(ks: Sequence[int], samples: int, temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"pass@k: temperature must be > 0 (greedy pass@1 is the greedy row), got {temperature}")
    if not ks or any(not 1 <= k <= samples for k in ks):
        raise ValueError(f"pass@k: every k must be in [1, samples={samples}], got {list(ks)}")


@torch.no_grad()
def sampled_pass_at_k(task: Task, model: Any, tok: Any, request: EvalRequest, sets: dict[str | None, list[Problem]], *,
                      stage: str, checkpoint: str, phase: PhaseFn | None = None) -> list[EvalRecord]:
    """pass@k per level (and pooled) from `request.n_samples` sampled answers per problem."""
    samples = request.n_samples
    check_ks(request.k, samples, request.temperature)
    engine = make_engine("native", model, tok)
    was_training = model.training
    model.eval()
    outcomes: list[ProblemOutcome] = []
    per_call = max(1, request.batch_size // samples)  # prompts per generate call: batch_size rows
    for level, problems in sets.items():
        prompts = [encode_prompt(p, tok) for p in problems]
        for i in range(0, len(prompts), per_call):
            params = SamplingParams(n=samples, temperature=request.temperature, max_new_tokens=request.max_new_tokens,
                                    seed=request.seed * 1_000_003 + i)
            chunk = problems[i : i + per_call]
            if phase is not None:
                with phase():
                    r = engine.generate(prompts[i : i + per_call], params)
            else:
                r = engine.generate(prompts[i : i + per_call], params)
            rows = [p for p in chunk for _ in range(samples)]  # prompt-major: the samples of prompt j are rows j·n … j·n + n − 1
            ok = task.judge(rows, r.texts, r.finish_reason)
            for j in range(len(chunk)):
                outcomes.append(ProblemOutcome(n=samples, c=sum(ok[j * samples : (j + 1) * samples]), level=level))
    model.train(was_training)
    name = f"{task.name}@T{request.temperature:g}"
    return [EvalRecord(stage, checkpoint, name, row.level, row.metric, row.value, row.n_problems, row.stderr)
            for row in pass_at_k_by_level(outcomes, request.k)]
