"""All rules over a run's streams, and doctor.json.

`STAGE_RULES` judge one stage's metric curves (they run live, during the stage, too); `RUN_RULES`
judge the between-stage evals (after each stage). A rule that raises is reported, never fatal: the
doctor must not be the thing that kills a run.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.doctor.findings import Finding
from posttrain.doctor.rules_numeric import grad_spike, non_finite, ratio_mismatch
from posttrain.doctor.rules_preference import likelihood_displacement, reward_scale_collapse
from posttrain.doctor.rules_rl import (clip_fraction_climb, difficulty_mismatch, entropy_collapse,
                                       importance_weight_drift, length_explosion, reward_overoptimization,
                                       verifier_gaming)
from posttrain.doctor.rules_sft import forgetting, overfitting
from posttrain.doctor.streams import RunStreams, StageStream, load_streams

StageRule = Callable[[StageStream], list[Finding]]
RunRule = Callable[[RunStreams], list[Finding]]

STAGE_RULES: tuple[StageRule, ...] = (
    non_finite, grad_spike, ratio_mismatch,
    overfitting,
    likelihood_displacement, reward_scale_collapse,
    reward_overoptimization, length_explosion, entropy_collapse, clip_fraction_climb, verifier_gaming,
    difficulty_mismatch, importance_weight_drift,
)
RUN_RULES: tuple[RunRule, ...] = (forgetting,)
RULE_NAMES = [r.__name__ for r in (*STAGE_RULES, *RUN_RULES)]


def diagnose_stage(stage: StageStream, errors: list[str] | None = None) -> list[Finding]:
    out: list[Finding] = []
    for rule in STAGE_RULES:
        try:
            out += rule(stage)
        except Exception as e:  # a bug in a rule is reported, not raised
            if errors is not None:
                errors.append(f"{rule.__name__} on {stage.name}: {type(e).__name__}: {e}")
    return out


def diagnose(run: RunStreams, errors: list[str] | None = None) -> list[Finding]:
    """Every finding of the run, most severe first, then by stage order and step."""
    out: list[Finding] = []
    for stage in run.stages:
        out += diagnose_stage(stage, errors)
    for rule in RUN_RULES:
        try:
            out += rule(run)
        except Exception as e:
            if errors is not None:
                errors.append(f"{rule.__name__}: {type(e).__name__}: {e}")
    order = {name: i for i, name in enumerate(run.stage_order)}
    return sorted(out, key=lambda f: (-f.severity.rank, order.get(f.stage, len(order)), f.first_step))


def write_doctor_json(run_dir: str | Path, *, cost: dict[str, Any] | None = None,
                      stopped: dict[str, Any] | None = None, live: list[Finding] | None = None) -> tuple[Path, list[Finding]]:
    """Diagnose the run folder and write `doctor.json` (atomically). `cost` merges into the earlier
    file's (a resumed run keeps its first part's); `stopped`: None keeps the earlier record, {} clears it;
    `live`: the findings the live doctor printed — one that no longer holds on the whole stream (a
    transient) is kept, marked as such."""
    run_dir = Path(run_dir)
    path = run_dir / "doctor.json"
    old: dict[str, Any] = {}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = {}
    errors: list[str] = []
    findings = diagnose(load_streams(run_dir), errors)
    keys = {f.key for f in findings}
    for f in live or []:  # printed during the run but no longer true of the whole stream: kept, and said so
        if f.key not in keys:
            findings.append(replace(f, summary=f"{f.summary} [seen live; no longer holds at the stage's end]"))
    doc = {"version": 1, "rules": RULE_NAMES, "findings": [f.to_json() for f in findings],
           "stopped": (stopped or None) if stopped is not None else old.get("stopped"),
           "cost": {**old.get("cost", {}), **(cost or {})}, "errors": errors}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
    os.replace(tmp, path)
    return path, findings


def read_findings(path: str | Path) -> list[Finding]:
    doc = json.loads(Path(path).read_text())
    return [Finding.from_json(d) for d in (doc.get("findings", []) if isinstance(doc, dict) else doc)]
