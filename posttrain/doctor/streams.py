"""The run's streams as the rules read them: per-stage metric curves, the between-stage evals, and
each stage's recipe entry (its kind and settings), from a run folder or from records in memory.

Rules never open files: `load_streams(run_dir)` does, once, and the live doctor builds the same
`StageStream` from the records it is handed as they are logged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from posttrain.doctor.stats import finite


@dataclass(frozen=True)
class Series:
    """One metric of one stage: `values[i]` logged at `steps[i]` (non-finite values kept: they are evidence)."""

    metric: str
    steps: list[int]
    values: list[float]

    def __len__(self) -> int:
        return len(self.steps)

    def clean(self) -> Series:
        """The finite points only."""
        s, v = finite(self.steps, self.values)
        return Series(self.metric, s, v)

    def since(self, step: int) -> Series:
        keep = [i for i, s in enumerate(self.steps) if s >= step]
        return Series(self.metric, [self.steps[i] for i in keep], [self.values[i] for i in keep])


@dataclass
class StageStream:
    """A stage's metrics.jsonl records, in order, plus its recipe entry (`kind` = sft, dpo, grpo, …)."""

    name: str
    kind: str
    config: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)

    def series(self, metric: str) -> Series:
        steps, values = [], []
        for r in self.records:
            v = r.get(metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                steps.append(int(r["step"]))
                values.append(float(v))
        return Series(metric, steps, values)

    def has(self, metric: str) -> bool:
        return any(metric in r for r in self.records)

    def metric_names(self) -> list[str]:
        names: dict[str, None] = {}
        for r in self.records:
            names.update(dict.fromkeys(r))
        return list(names)

    @property
    def last_step(self) -> int:
        return int(self.records[-1]["step"]) if self.records else 0


@dataclass(frozen=True)
class EvalRow:
    """One evals.jsonl row (posttrain.tasks.records.EvalRecord as JSON)."""

    stage: str
    eval: str
    level: str | None
    metric: str
    value: float
    n: int

    @property
    def key(self) -> tuple[str, str | None, str]:
        return (self.eval, self.level, self.metric)


@dataclass
class RunStreams:
    stages: list[StageStream]
    evals: list[EvalRow] = field(default_factory=list)
    stage_order: list[str] = field(default_factory=list)  # base, then the recipe's stages in order


def stage_kinds(recipe: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Folder name → the stage's recipe entry (with `stage` = its kind)."""
    return {str(s.get("name") or s["stage"]): s for s in recipe.get("stages", []) if isinstance(s, dict) and "stage" in s}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON Lines, skipping a line cut by a kill; Python's reader keeps NaN/Infinity."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict):
            out.append(r)
    return out


def build_streams(recipe: dict[str, Any], records: list[dict[str, Any]], evals: list[dict[str, Any]]) -> RunStreams:
    kinds = stage_kinds(recipe)
    by_stage: dict[str, StageStream] = {}
    for r in records:
        name = str(r.get("stage", ""))
        if name not in by_stage:
            cfg = kinds.get(name, {})
            by_stage[name] = StageStream(name, str(cfg.get("stage", name)), cfg)
        by_stage[name].records.append(r)
    rows = []
    for d in evals:
        try:
            v = float(d["value"])
            rows.append(EvalRow(str(d["stage"]), str(d["eval"]), d.get("level"), str(d["metric"]), v, int(d.get("n") or 0)))
        except (KeyError, TypeError, ValueError):
            continue
    order = ["base", *kinds]
    return RunStreams([by_stage[k] for k in sorted(by_stage, key=lambda k: order.index(k) if k in order else len(order))],
                      [r for r in rows if math.isfinite(r.value)], order)


def load_streams(run_dir: str | Path) -> RunStreams:
    run_dir = Path(run_dir)
    recipe_path = run_dir / "recipe.yaml"
    recipe = (yaml.safe_load(recipe_path.read_text()) or {}) if recipe_path.is_file() else {}
    return build_streams(recipe, read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "evals.jsonl"))
