"""Between-stage evaluations — the "bisect" table: exactly the evals the recipe names, on every
checkpoint of the pipeline, so a drop localizes to the stage that caused it.

Each eval is its task's (`Task.evaluate`, posttrain/tasks/): the arithmetic task's format / exact
match per level and prose probe, a problem file's greedy pass@1 under its verifier, HumanEval's
pass@k, … A recipe without `evals` runs none.

Each row the pipeline appends to evals.jsonl carries its bisect mark (`marked_rows`): the comparison
with the previous checkpoint that holds the same (eval, level, metric) — `vs` (that checkpoint),
`delta` (this value − that one), `threshold` (2 standard errors of the difference) and `moved`
(up | down | none | unknown) — by `report.eval_bisect.move`, the one rule `posttrain bisect` and the
report use. A checkpoint's first row of a kind has none of these fields, nor has a run written before
they existed; readers take the EvalRecord fields and ignore the rest (`record_from_json`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from posttrain.runtime.config import EvalSpec
from posttrain.rollout.greedy import PhaseFn
from posttrain.judges.constitution import load_constitution
from posttrain.report.eval_bisect import Z, move
from posttrain.report.summaries import EvalCell
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


# The bisect verdicts as evals.jsonl spells them: report.eval_bisect's "flat" is "none" (no move).
MOVED = {"up": "up", "down": "down", "flat": "none", "unknown": "unknown"}
_RECORD_FIELDS = {f.name for f in fields(EvalRecord)}


def record_from_json(row: dict) -> EvalRecord:
    """One evals.jsonl row as an EvalRecord: its own fields, the bisect marks (and any later field) ignored.
    Raises TypeError on a row missing a field (the caller decides whether to skip it)."""
    return EvalRecord(**{k: v for k, v in row.items() if k in _RECORD_FIELDS})


def _row_key(row: dict) -> tuple[Any, Any, Any]:
    return (row.get("eval"), row.get("level"), row.get("metric"))


def marked_rows(records: list[EvalRecord], previous: list[dict]) -> list[dict]:
    """`records` (one checkpoint's) as evals.jsonl rows, each with its bisect mark against the last row
    of `previous` (the file so far, pipeline order) that has the same key, a number, and another stage.
    A row with no such earlier row is written unmarked."""
    numbered = [row for row in previous
                if isinstance(v := row.get("value"), (int, float)) and not isinstance(v, bool) and v == v]
    out = []
    for r in records:
        row = asdict(r)
        # the previous checkpoint: the last earlier row of this kind from another stage (the same stage
        # evaluated again, as a resumed run does, is not a move)
        before = next((p for p in reversed(numbered) if _row_key(p) == _row_key(row) and p.get("stage") != r.stage), None)
        m = None if before is None else move(EvalCell(before.get("value"), before.get("stderr"), before.get("n")),
                                             EvalCell(r.value, r.stderr, r.n), from_=str(before.get("stage")), to=r.stage)
        if m is not None:
            row.update(vs=m.before, delta=m.delta, threshold=None if m.se is None else Z * m.se, moved=MOVED[m.verdict])
        out.append(row)
    return out


def read_rows(path: Path) -> list[dict]:
    """evals.jsonl's rows as dicts (a torn last line, from a killed run, is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def append_evals(path: Path, records: list[EvalRecord]) -> list[dict]:
    """Append one checkpoint's records to evals.jsonl with their bisect marks; returns the rows written."""
    rows = marked_rows(records, read_rows(path))
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def evaluate_checkpoint(checkpoint: str, spec: EvalSpec, *, seed: int = 0, threads: int | None = None,
                        device: str = "cpu") -> list[EvalRecord]:
    """`posttrain eval`: one eval of any HF checkpoint folder (ours or not; or a named built-in
    checkpoint such as smollm2-135m-instruct), nothing else built. Returns its EvalRecords."""
    import torch

    from posttrain.models import checkpoint_folder, load_model, load_tokenizer
    from posttrain.models.cpu_math import use_threads
    from posttrain.runtime.context import eval_key, eval_request
    from posttrain.tasks import TaskSet, build_task
    from posttrain.tasks.verified import JsonlTask

    use_threads(threads)  # the thread count, and the vector math primed before the first forward (models/cpu_math.py)
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
