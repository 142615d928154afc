"""The constitution's rule-checked compliance on a task's held-out problems, beside the task's own
gold accuracy on the same greedy replies — so a compliance gain that costs accuracy shows.

Rows (EvalRecord), eval `<task>/constitution`, per level and pooled (level None): metric
`comply/<principle>` = the compliant share of the replies the principle applies to (`n` counts those
replies: a "show the work for multi-digit problems" rule is not scored on 3 + 4); `comply/all` = the
share of replies compliant with every checked principle that applies to them; `accuracy` = the task's
own judge (arithmetic: exact match) on the same replies. `stderr`: binomial, sqrt(p(1 − p)/n).
Greedy decoding, so the numbers move only with the checkpoint. docs/constitutional_ai.md.
"""

from __future__ import annotations

from typing import Any

from posttrain.data import encode_prompt
from posttrain.judges.checkers import CHECKERS
from posttrain.judges.constitution import Constitution
from posttrain.rollout.greedy import greedy
from posttrain.tasks.evaluate import Task, eval_sets, rate
from posttrain.tasks.records import EvalRecord, EvalRequest, PhaseFn


def verdict_table(constitution: Constitution, problems: list, texts: list[str]) -> dict[str, list[bool | None]]:
    """Per checked principle, per reply: complies (True/False) or does not apply (None)."""
    out: dict[str, list[bool | None]] = {}
    for p in constitution.checked:
        verdicts = [CHECKERS[p.check](q, t) for q, t in zip(problems, texts)]  # type: ignore[index]
        out[p.name] = [v.ok if v.applies else None for v in verdicts]
    return out


def level_rows(name: str, level: str | None, table: dict[str, list[bool | None]], correct: list[bool], *,
               stage: str, checkpoint: str) -> list[EvalRecord]:
    rows = []
    for principle, verdicts in table.items():
        applied = [v for v in verdicts if v is not None]
        rows.append(rate(stage, checkpoint, name, level, f"comply/{principle}", sum(applied), len(applied)))
    every = [all(table[p][i] is not False for p in table) for i in range(len(correct))]
    rows.append(rate(stage, checkpoint, name, level, "comply/all", sum(every), len(every)))
    rows.append(rate(stage, checkpoint, name, level, "accuracy", sum(correct), len(correct)))
    return rows


def evaluate_constitution(task: Task, model: Any, tok: Any, request: EvalRequest, constitution: Constitution, *,
                          stage: str, checkpoint: str, phase: PhaseFn | None = None) -> list[EvalRecord]:
    name = f"{task.name}/constitution"
    out: list[EvalRecord] = []
    pooled: dict[str, list[bool | None]] = {p.name: [] for p in constitution.checked}
    pooled_correct: list[bool] = []
    sets = eval_sets(task, request)
    for level, problems in sets.items():
        texts, reasons = greedy(model, tok, [encode_prompt(p, tok) for p in problems], request.max_new_tokens,
                                request.batch_size, phase)
        table = verdict_table(constitution, problems, texts)
        correct = list(task.judge(problems, texts, reasons))
        out += level_rows(name, level, table, correct, stage=stage, checkpoint=checkpoint)
        for k, v in table.items():
            pooled[k] += v
        pooled_correct += correct
    if len(sets) > 1:
        out += level_rows(name, None, pooled, pooled_correct, stage=stage, checkpoint=checkpoint)
    return out
