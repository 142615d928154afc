"""Quality gates on what a collect step keeps (issue 25: "at every ingestion point"; docs/gates.md).

A rejection-sampling stage with `gates: [exact_dedup, near_dedup, decontaminate]` passes the rows it is
about to write — its SFT rows, and its preference pairs with `pairs: true` — through those gates, in
the order listed, and logs each gate's counts with the stage's summary row (`gate/<gate>/seen`,
`…/kept`, `…/removed/<reason>`; pairs as `gate/pairs.<gate>/…`): inside a rounds block, one set of
counts per round. Decontamination is against every held-out problem of the recipe's `evals` (each
eval's levels, or its task's levels), the eval prompts a later score would read.

Departures: 1. the gates run on the stage's rows after its own per-prompt selection and exact
(whitespace-collapsed) dedup, so `exact_dedup` mostly finds nothing new; it is there for the
case-folded, Unicode-normalized comparison docs/gates.md describes. 2. Length and format filters are
not offered here: the stage already drops a reply cut by the budget or empty (departure 1 of
rejection_sampling.py), and a format check belongs to the verifier that scored it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from posttrain.data import parse_record
from posttrain.data.gates import EvalIndex, GateReport, decontaminate, eval_index, exact_dedup, near_dedup, run_gates
from posttrain.runtime.context import RunContext, eval_key
from posttrain.tasks import Capability

GateName = Literal["exact_dedup", "near_dedup", "decontaminate"]


def recipe_eval_index(ctx: RunContext) -> EvalIndex:
    """Every held-out problem the recipe's evals score, indexed for decontamination."""
    prompts = []
    for e in ctx.recipe.evals:
        task = ctx.tasks.get(eval_key(e))
        if not task.has(Capability.EVALS):
            continue
        for level in (e.levels or list(task.levels) or [None]):
            prompts += [(f"{eval_key(e)}[{level}][{i}]", p) for i, p in enumerate(task.eval_problems(level))]
    return eval_index(prompts)


def gate_rows(rows: list[dict], kind: str, names: Sequence[GateName], index: EvalIndex | None,
              where: str) -> tuple[list[dict], list[GateReport]]:
    """`rows` (our JSONL schema `kind`) after the gates `names`, in order, and each gate's report."""
    if not names:
        return rows, []
    records = [parse_record(r, kind, f"{where}:{i + 1}") for i, r in enumerate(rows)]
    by_id = {id(rec): row for rec, row in zip(records, rows)}
    gates = {"exact_dedup": exact_dedup, "near_dedup": near_dedup,
             "decontaminate": lambda recs: decontaminate(recs, index)}
    kept, reports = run_gates(records, [gates[n] for n in names])
    return [by_id[id(rec)] for rec in kept], reports


def gate_metrics(reports: Sequence[GateReport], prefix: str = "") -> dict[str, float]:
    """The reports' counts as metrics; `prefix` (e.g. "pairs.") names the file they gated."""
    out: dict[str, float] = {}
    for r in reports:
        for key, n in r.metrics().items():
            out[key.replace("gate/", f"gate/{prefix}", 1)] = float(n)
    return out
