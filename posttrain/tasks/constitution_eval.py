"""The constitution's rule-checked compliance on a task's held-out problems, beside the task's own
gold accuracy on the same greedy replies — so a compliance gain that costs accuracy shows.

Rows (EvalRecord), eval `<task>/constitution`, per level and pooled (level None): metric
`comply/<principle>` = the compliant share of the replies the principle applies to (`n` counts those
replies: a "show the work for multi-digit problems" rule is not scored on 3 + 4); `comply/all` = the
share of replies compliant with every checked principle that applies to them; `accuracy` = the task's
own judge (arithmetic: exact match) on the same replies. `stderr`: binomial, sqrt(p(1 − p)/n).
Greedy decoding, so the numbers move only with the checkpoint.

With sampled pass@k asked for (`k`), the same rows again under eval `<task>/constitution@T<temperature>`
from `samples` seeded samples per problem — where a policy's minority behaviour (filler in 30% of its
demonstrations, say) shows, which greedy decoding hides. `n` counts the replies a principle applies
to; the samples of one problem are not independent, so `stderr` is the cluster (by problem) standard
error of a ratio: sqrt(Σ_i (c_i − p·m_i)²) / Σ_i m_i, with c_i of m_i replies of problem i compliant.
docs/constitutional_ai.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from posttrain.data import encode_prompt
from posttrain.judges.checkers import CHECKERS
from posttrain.judges.constitution import Constitution
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.greedy import greedy
from posttrain.tasks.evaluate import Task, eval_sets, rate
from posttrain.tasks.records import EvalRecord, EvalRequest, PhaseFn

Verdicts = list["bool | None"]


def verdict_table(constitution: Constitution, problems: list, texts: list[str]) -> dict[str, list[bool | None]]:
    """Per checked principle, per reply: complies (True/False) or does not apply (None)."""
    out: dict[str, list[bool | None]] = {}
    for p in constitution.checked:
        verdicts = [CHECKERS[p.check](q, t) for q, t in zip(problems, texts)]  # type: ignore[index]
        out[p.name] = [v.ok if v.applies else None for v in verdicts]
    return out


def clustered(stage: str, checkpoint: str, name: str, level: str | None, metric: str, verdicts: Verdicts,
              group: int) -> EvalRecord:
    """A compliance rate over replies in clusters of `group` (the samples of one problem): the pooled
    rate, with the cluster standard error of a ratio (module docstring). group 1: the binomial one."""
    if group == 1:
        applied = [v for v in verdicts if v is not None]
        return rate(stage, checkpoint, name, level, metric, sum(applied), len(applied))
    counts = []
    for i in range(0, len(verdicts), group):
        applied = [v for v in verdicts[i:i + group] if v is not None]
        counts.append((sum(applied), len(applied)))
    m = sum(n for _, n in counts)
    p = sum(c for c, _ in counts) / m if m else float("nan")
    se = math.sqrt(sum((c - p * n) ** 2 for c, n in counts)) / m if m else float("nan")
    return EvalRecord(stage, checkpoint, name, level, metric, p, m, se)


def level_rows(name: str, level: str | None, table: dict[str, Verdicts], correct: list[bool], *,
               stage: str, checkpoint: str, group: int = 1) -> list[EvalRecord]:
    rows = [clustered(stage, checkpoint, name, level, f"comply/{p}", v, group) for p, v in table.items()]
    every: Verdicts = [all(table[p][i] is not False for p in table) for i in range(len(correct))]
    rows.append(clustered(stage, checkpoint, name, level, "comply/all", every, group))
    rows.append(clustered(stage, checkpoint, name, level, "accuracy", list(correct), group))
    return rows


@torch.no_grad()
def evaluate_constitution(task: Task, model: Any, tok: Any, request: EvalRequest, constitution: Constitution, *,
                          stage: str, checkpoint: str, phase: PhaseFn | None = None) -> list[EvalRecord]:
    sets = eval_sets(task, request)
    out: list[EvalRecord] = []
    if request.greedy:
        def decode_greedy(problems: list) -> tuple[list[str], list[str]]:
            return greedy(model, tok, [encode_prompt(p, tok) for p in problems], request.max_new_tokens, request.batch_size, phase)

        out += compliance_rows(f"{task.name}/constitution", task, sets, constitution, decode_greedy, 1,
                               stage=stage, checkpoint=checkpoint)
    if request.k:
        n = request.n_samples
        engine = make_engine("native", model, tok)
        per_call = max(1, request.batch_size // n)

        def decode_sampled(problems: list) -> tuple[list[str], list[str]]:
            texts, reasons = [], []
            for i in range(0, len(problems), per_call):
                params = SamplingParams(n=n, temperature=request.temperature, max_new_tokens=request.max_new_tokens,
                                        seed=request.seed * 1_000_003 + 7 * i + 1)
                ro = engine.generate([encode_prompt(p, tok) for p in problems[i:i + per_call]], params)
                texts += ro.texts
                reasons += ro.finish_reason
            return texts, reasons

        was_training = model.training
        model.eval()
        out += compliance_rows(f"{task.name}/constitution@T{request.temperature:g}", task, sets, constitution, decode_sampled,
                               n, stage=stage, checkpoint=checkpoint)
        model.train(was_training)
    return out


def compliance_rows(name: str, task: Task, sets: dict, constitution: Constitution, decode, group: int, *,
                    stage: str, checkpoint: str) -> list[EvalRecord]:
    """Rows per level and pooled; `decode(problems)` → (texts, finish reasons), `group` replies per problem, prompt-major."""
    out: list[EvalRecord] = []
    pooled: dict[str, Verdicts] = {p.name: [] for p in constitution.checked}
    pooled_correct: list[bool] = []
    for level, problems in sets.items():
        texts, reasons = decode(problems)
        rows = [p for p in problems for _ in range(group)]
        table = verdict_table(constitution, rows, texts)
        correct = list(task.judge(rows, texts, reasons))
        out += level_rows(name, level, table, correct, stage=stage, checkpoint=checkpoint, group=group)
        for k, v in table.items():
            pooled[k] += v
        pooled_correct += correct
    if len(sets) > 1:
        out += level_rows(name, None, pooled, pooled_correct, stage=stage, checkpoint=checkpoint, group=group)
    return out
