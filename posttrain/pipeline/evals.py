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
from posttrain.judges.constitution import load_constitution
from posttrain.tasks import EvalRecord, EvalRequest, Task
from posttrain.tasks.constitution_eval import evaluate_constitution


def renamed(records: list[EvalRecord], task: Task, name: str | None) -> list[EvalRecord]:
    """Records of `task` under the recipe's eval `name` (`code` → `name`, `code@T1` → `name@T1`,
    `code/constitution` → `name/constitution`)."""
    if not name or name == task.name:
        return records
    return [replace(r, eval=name + r.eval[len(task.name):]) if r.eval == task.name or r.eval.startswith((task.name + "@", task.name + "/"))
            else r for r in records]


def run_evals(plan: list[tuple[EvalSpec, Task, EvalRequest]], model: Any, tok: Any, *, stage: str, checkpoint: str,
              phase: PhaseFn | None = None, round_k: int | None = None) -> list[EvalRecord]:
    """Every eval of the plan on one checkpoint, in the recipe's order; `round_k`: the stage's round
    (rows carry it as `round`), None outside rounds."""
    out: list[EvalRecord] = []
    for spec, task, request in plan:
        out += renamed(task.evaluate(model, tok, request, stage=stage, checkpoint=checkpoint, phase=phase), task, spec.name)
        if spec.constitution is not None:  # a second greedy pass over the same problems (cost: one more eval's decode)
            out += renamed(evaluate_constitution(task, model, tok, request, load_constitution(spec.constitution),
                                                 stage=stage, checkpoint=checkpoint, phase=phase), task, spec.name)
    return out if round_k is None else [replace(r, round=round_k) for r in out]


def as_json(records: list[EvalRecord]) -> list[dict]:
    return [asdict(r) for r in records]


def evaluate_checkpoint(checkpoint: str, spec: EvalSpec, *, seed: int = 0, threads: int | None = None,
                        device: str = "cpu") -> list[EvalRecord]:
    """`posttrain eval`: one eval of any HF checkpoint folder (ours or not; or a named built-in
    checkpoint such as smollm2-135m-instruct), nothing else built. Returns its EvalRecords."""
    import torch

    from posttrain.models import checkpoint_folder, load_model, load_tokenizer
    from posttrain.runtime.context import eval_key, eval_request
    from posttrain.tasks import TaskSet, build_task
    from posttrain.tasks.verified import JsonlTask

    if threads:
        torch.set_num_threads(threads)
    folder = checkpoint_folder(checkpoint)
    tok, model = load_tokenizer(folder), load_model(folder, device=torch.device(device))
    task = (build_task(spec.task, arithmetic_eval_per_level=spec.per_level_or_default or 0) if spec.task is not None
            else JsonlTask(spec.path, spec.verifier or "", name=spec.name, params=spec.params))
    tasks = TaskSet({eval_key(spec): lambda: task})
    try:
        return run_evals([(spec, tasks.get(eval_key(spec)), eval_request(spec, seed=seed))], model, tok,
                         stage="eval", checkpoint=str(checkpoint))
    finally:
        tasks.close()


def eval_table(records: list[EvalRecord]):
    """A rich table of eval rows: eval · metric, level, value ± standard error, problems."""
    from rich.table import Table

    table = Table(title="posttrain eval")
    for col, justify in (("eval", "left"), ("metric", "left"), ("level", "left"), ("value", "right"),
                         ("± stderr", "right"), ("n", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in records:
        se = "" if r.stderr is None or r.stderr != r.stderr else f"{100 * r.stderr:.1f}"
        table.add_row(r.eval, r.metric, r.level or "all", f"{100 * r.value:.1f}%", se, str(r.n))
    return table
