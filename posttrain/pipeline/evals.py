"""Between-stage evaluations — the "bisect" table: exactly the evals the recipe names, on every
checkpoint of the pipeline, so a drop localizes to the stage that caused it.

Each eval is its task's (`Task.evaluate`, posttrain/tasks/): the arithmetic task's format / exact
match per level and prose probe, a problem file's greedy pass@1 under its verifier, HumanEval's
pass@k, … A recipe without `evals` runs none.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from posttrain.runtime.config import EvalSpec
from posttrain.rollout.greedy import PhaseFn
from posttrain.tasks import EvalRecord, EvalRequest, Task


def renamed(records: list[EvalRecord], task: Task, name: str | None) -> list[EvalRecord]:
    """Records of `task` under the recipe's eval `name` (`code` → `name`, `code@T1` → `name@T1`)."""
    if not name or name == task.name:
        return records
    return [replace(r, eval=name + r.eval[len(task.name):]) if r.eval == task.name or r.eval.startswith(task.name + "@")
            else r for r in records]


def run_evals(plan: list[tuple[EvalSpec, Task, EvalRequest]], model: Any, tok: Any, *, stage: str, checkpoint: str,
              phase: PhaseFn | None = None) -> list[EvalRecord]:
    """Every eval of the plan on one checkpoint, in the recipe's order."""
    out: list[EvalRecord] = []
    for spec, task, request in plan:
        out += renamed(task.evaluate(model, tok, request, stage=stage, checkpoint=checkpoint, phase=phase), task, spec.name)
    return out


def as_json(records: list[EvalRecord]) -> list[dict]:
    return [asdict(r) for r in records]
