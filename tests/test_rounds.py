"""Rounds: a block of stages repeated N times, expanded into ordinary stages named `r<k>.<name>`
(docs/rounds.md); and every stage logging under its own name, which rounds rely on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tiny_recipe_dict
from posttrain.pipeline.run import run_pipeline
from posttrain.runtime.config import Recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_sft_stages_log_metrics_evals_and_phases_under_their_own_names(tmp_path):
    d = tiny_recipe_dict(threads=1, telemetry={"measure_cpu": False},
                         evals=[{"task": "arithmetic", "per_level": 2, "levels": ["L1"], "max_new_tokens": 8, "batch_size": 8}])
    d["stages"][0].update(steps=2, save_every=2)
    sft = {**d["stages"][1], "steps": 2, "save_every": 2, "heldout": 4}
    d["stages"] = [d["stages"][0], sft, {**sft, "name": "sft_rs"}]
    run_pipeline(Recipe.model_validate(d), tmp_path / "run")
    metrics = _jsonl(tmp_path / "run" / "metrics.jsonl")
    phases = _jsonl(tmp_path / "run" / "phases.jsonl")
    evals = _jsonl(tmp_path / "run" / "evals.jsonl")
    for name in ("pretrain", "sft", "sft_rs"):
        # log_every 1: one row per step, and the last one carries the held-out loss
        assert [m["step"] for m in metrics if m["stage"] == name] == [1, 2], name
        assert {p["name"] for p in phases if p["stage"] == name} >= {"update", "eval"}, name
        assert {e["stage"] for e in evals} >= {name}
    # the second SFT's update phases are its own two steps, not folded into the first's
    assert len([p for p in phases if p["stage"] == "sft" and p["name"] == "update"]) == 2
    assert len([p for p in phases if p["stage"] == "sft_rs" and p["name"] == "update"]) == 2
