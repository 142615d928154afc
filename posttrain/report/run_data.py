"""Read a run folder (docs/run_dir.md) into typed records the report draws from.

Every file is optional except that a report of nothing is an error: a run killed before its first
step still has `recipe.yaml` and `device.json`, and its report says what is missing. JSON Lines
readers tolerate a truncated last line (the line a killed run was writing) and nothing else: a broken
line in the middle names the file and the line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from posttrain.telemetry.devices import Peaks
from posttrain.telemetry.phases import PhaseRecord, read_phases
from posttrain.telemetry.revision import Revision, net, recorded, revise
from posttrain.telemetry.sinks import read_jsonl_records

BASE = "base"  # the checkpoint before the first post-training stage (posttrain.pipeline.run.BASE)


class ReportError(ValueError):
    """A run folder the report cannot read: missing, empty, or holding a malformed record."""


@dataclass(frozen=True)
class StageInfo:
    """One stage of the pipeline, in recipe order: its folder name (the `stage` of every record) and kind."""

    name: str            # checkpoint folder = `name` in the recipe, else the kind
    kind: str            # pretrain | sft | reward_model | dpo | ppo | grpo | …
    steps: int | None    # optimizer steps the recipe asked for (None: not in a recipe)


@dataclass
class RunData:
    run_dir: Path
    recipe: dict[str, Any]
    stages: list[StageInfo]                       # recipe order, then stages seen only in the records
    metrics: list[dict[str, Any]]
    phases: list[PhaseRecord]
    device: dict[str, Any] | None
    evals: list[dict[str, Any]]
    doctor: Any | None                            # doctor.json as written (a later issue defines it)
    missing: list[str] = field(default_factory=list)  # files the run folder lacks
    memory: list[dict[str, Any]] = field(default_factory=list)  # memory.jsonl: the largest known consumers
    revisions: list[Revision] = field(default_factory=list)     # roofs lifted (run time and report time), one per roof
    revised_peaks: Peaks | None = None            # device.json's peaks lifted to every rate the phases achieved

    @property
    def peaks(self) -> Peaks:
        """The roofs every number of the report is against: never below a rate a phase achieved."""
        if self.revised_peaks is not None:
            return self.revised_peaks
        if self.device is None:
            return Peaks(name="unknown (no device.json)", kind="?")
        return Peaks.from_json(self.device)

    @property
    def dtype(self) -> str:
        return (self.device or {}).get("dtype", "fp32")

    @property
    def peak_flops(self) -> float | None:
        return self.peaks.flops_for(self.dtype)

    @property
    def peak_bytes_per_s(self) -> float | None:
        return self.peaks.bytes_per_s

    def stage_metrics(self, stage: str) -> list[dict[str, Any]]:
        return [m for m in self.metrics if m.get("stage") == stage]

    def stage_phases(self, stage: str) -> list[PhaseRecord]:
        return [p for p in self.phases if p.stage == stage]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Objects of a JSON Lines file; a cut last line is dropped, any other bad line is an error."""
    try:
        return [obj for _, obj in read_jsonl_records(path)]
    except ValueError as e:
        raise ReportError(str(e)) from None


def _recipe_stages(recipe: dict[str, Any]) -> list[StageInfo]:
    out = []
    for i, s in enumerate(recipe.get("stages") or []):
        if not isinstance(s, dict) or "stage" not in s:
            raise ReportError(f"recipe.yaml: stages.{i} has no `stage` kind; expected a stage mapping as "
                              "`posttrain run` writes it")
        steps = s.get("steps")
        out.append(StageInfo(name=s.get("name") or s["stage"], kind=str(s["stage"]),
                             steps=int(steps) if isinstance(steps, int) else None))
    return out


def load_run(run_dir: str | Path) -> RunData:
    """Read everything the report needs from `run_dir`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run directory {run_dir} does not exist; expected a folder written by "
                          "`posttrain run` (runs/<name>/)")
    missing: list[str] = []

    def optional(name: str) -> Path | None:
        path = run_dir / name
        if path.is_file():
            return path
        missing.append(name)
        return None

    recipe: dict[str, Any] = {}
    if (p := optional("recipe.yaml")) is not None:
        try:
            recipe = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ReportError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(recipe, dict):
            raise ReportError(f"{p}: expected a mapping at the top level")
    metrics = read_jsonl(p) if (p := optional("metrics.jsonl")) else []
    try:
        phases = read_phases(p) if (p := optional("phases.jsonl")) else []
    except (ValueError, KeyError, TypeError) as e:
        raise ReportError(str(e)) from None
    evals = read_jsonl(p) if (p := optional("evals.jsonl")) else []
    device = json.loads(p.read_text()) if (p := optional("device.json")) else None
    doctor = json.loads(p.read_text()) if (p := run_dir / "doctor.json").is_file() else None
    memory = read_jsonl(p) if (p := run_dir / "memory.jsonl").is_file() else []  # absent before memory was recorded
    if not (metrics or phases or evals):
        raise ReportError(f"{run_dir}: no metrics.jsonl, phases.jsonl or evals.jsonl records yet — nothing to "
                          "report (did a stage reach its first logged step?)")

    stages = _recipe_stages(recipe)
    known = {s.name for s in stages} | {BASE}
    for rec in [*metrics, *({"stage": p.stage} for p in phases), *evals]:
        name = rec.get("stage")
        if isinstance(name, str) and name not in known:
            stages.append(StageInfo(name=name, kind=name, steps=None))
            known.add(name)
    revised, revisions = None, []
    if device is not None:
        dtype = device.get("dtype", "fp32")
        revised, late = revise(Peaks.from_json(device), dtype, phases)  # a run killed before it rewrote device.json
        revisions = net(recorded(device) + late)
    return RunData(run_dir=run_dir, recipe=recipe, stages=stages, metrics=metrics, phases=phases,
                   device=device, evals=evals, doctor=doctor, missing=missing, memory=memory,
                   revisions=revisions, revised_peaks=revised)


def finite_or_none(x: Any) -> float | None:
    """A JSON-safe number: NaN/±Infinity (which metrics.jsonl may hold, as evidence) become None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None
