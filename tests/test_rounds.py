"""Rounds: a block of stages repeated N times, expanded into ordinary stages named `r<k>.<name>`
(docs/rounds.md); and every stage logging under its own name, which rounds rely on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from conftest import tiny_recipe_dict
from posttrain.pipeline.run import run_pipeline
from posttrain.runtime.config import Recipe, RecipeError, dump_recipe, load_recipe
from posttrain.runtime.rounds import expand_rounds

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


# ---- expansion ---------------------------------------------------------------------------------
def _block(repeat=2, stages=None) -> dict:
    return {"rounds": {"repeat": repeat, "stages": stages if stages is not None else [
        {"stage": "rejection_sampling", "data": [{"task": "arithmetic", "n": 8}], "draw": "{round}",
         "output": "out/r{round}/sft.jsonl", "rewards": [{"name": "length", "params": {"note": "from r{prev_round}"}}]},
        {"stage": "sft", "name": "sft_rs", "data": [{"path": "out/r{round}/sft.jsonl"}]},
    ]}}


def _recipe(*stages) -> dict:
    return {"name": "x", "stages": [{"stage": "pretrain", "steps": 2}, *stages]}


def test_a_block_becomes_ordinary_stages_named_by_round():
    recipe = Recipe.model_validate(_recipe(_block(repeat=3), {"stage": "sft", "data": [{"task": "arithmetic", "n": 8}]}))
    assert [s.folder for s in recipe.stages] == [
        "pretrain", "r1.rejection_sampling", "r1.sft_rs", "r2.rejection_sampling", "r2.sft_rs",
        "r3.rejection_sampling", "r3.sft_rs", "sft"]
    assert [s.round for s in recipe.stages] == [None, 1, 1, 2, 2, 3, 3, None]


def test_round_and_prev_round_are_substituted_in_every_string():
    rs1, sft1, rs2, sft2 = Recipe.model_validate(_recipe(_block())).stages[1:]
    assert (str(rs1.output), str(sft1.data[0].path)) == ("out/r1/sft.jsonl", "out/r1/sft.jsonl")
    assert (str(rs2.output), str(sft2.data[0].path)) == ("out/r2/sft.jsonl", "out/r2/sft.jsonl")
    assert (rs1.draw, rs2.draw) == (1, 2)  # "{round}" → "2" → the int field reads 2
    assert rs2.rewards[0].params == {"note": "from r1"}  # nested, and {prev_round} = k − 1
    assert rs1.rewards[0].params == {"note": "from r0"}  # round 1's previous round is 0: names nothing


def test_a_recipe_without_rounds_is_left_as_written():
    raw = _recipe({"stage": "sft", "data": [{"path": "a{b}.jsonl"}]})
    assert expand_rounds(raw) == (raw, ["stages[0]", "stages[1]"])


def test_the_resolved_recipe_reloads_as_the_same_recipe(tmp_path):
    recipe = Recipe.model_validate(_recipe(_block()))
    (tmp_path / "recipe.yaml").write_text(dump_recipe(recipe))
    assert load_recipe(tmp_path / "recipe.yaml") == recipe  # dotted names and `round` fields are valid as written


def test_overrides_reach_into_a_block(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_recipe(_block())))
    recipe = load_recipe(path, ["stages.1.rounds.repeat=1", "stages.1.rounds.stages.1.steps=7"])
    assert [(s.folder, s.steps) for s in recipe.stages[1:]] == [("r1.rejection_sampling", 1), ("r1.sft_rs", 7)]


@pytest.mark.parametrize(("item", "where", "says"), [
    ({"rounds": {"repeat": 0, "stages": [{"stage": "pretrain"}]}}, "stages[1].rounds.repeat", "integer ≥ 1"),
    ({"rounds": {"repeat": "two", "stages": [{"stage": "pretrain"}]}}, "stages[1].rounds.repeat", "integer ≥ 1"),
    ({"rounds": {"repeat": True, "stages": [{"stage": "pretrain"}]}}, "stages[1].rounds.repeat", "integer ≥ 1"),
    ({"rounds": {"stages": [{"stage": "pretrain"}]}}, "stages[1].rounds.repeat", "(got None)"),
    ({"rounds": {"repeat": 2, "stages": []}}, "stages[1].rounds.stages", "non-empty list"),
    ({"rounds": {"repeat": 2, "stages": [{"stage": "pretrain"}]}, "name": "x"}, "stages[1]", "not also ['name']"),
    ({"rounds": {"repeat": 2, "times": 3, "stages": [{"stage": "pretrain"}]}}, "stages[1].rounds.times", "unknown key"),
    ({"rounds": {"repeat": 2, "stages": [{"stage": "pretrain"}, _block()]}}, "stages[1].rounds.stages[1]", "cannot nest"),
    ({"rounds": {"repeat": 2, "stages": [{"stage": "pretrain", "round": 1}]}}, "stages[1].rounds.stages[0].round",
     "set by the rounds block"),
    # two copies of the same kind and no names: both would be r1.pretrain
    ({"rounds": {"repeat": 2, "stages": [{"stage": "pretrain"}, {"stage": "pretrain"}]}}, "stages[1].rounds.stages[1].name",
     "'r1.pretrain' is also that of stages[1].rounds.stages[0]"),
    ({"stage": "pretrain", "name": "out/{round}"}, "stages[1].name", "only inside a rounds block"),
    ({"rounds": {"repeat": 2, "stages": [{"stage": "pretrain", "stepz": 3}]}}, "stages[1].rounds.stages[0].stepz",
     "unknown key"),
])
def test_a_bad_block_is_a_recipe_error_naming_the_field(tmp_path, item, where, says):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_recipe(item)))
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    lines = str(err.value).splitlines()
    assert len(lines) == 1, lines  # a typo inside a block repeated N times is said once
    assert lines[0].startswith(f"{path}: {where}: ") and says in lines[0], lines[0]


def test_a_copy_clashing_with_a_plain_stage_names_both(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"stages": [{"stage": "pretrain", "name": "r2.pretrain"},
                                               {"rounds": {"repeat": 2, "stages": [{"stage": "pretrain"}]}}]}))
    with pytest.raises(RecipeError, match=r"stages\[1\]\.rounds\.stages\[0\]\.name: stage name 'r2.pretrain' is also that of stages\[0\]"):
        load_recipe(path)


def test_a_stage_name_is_a_folder_name():
    with pytest.raises(ValidationError, match="name"):
        Recipe.model_validate({"stages": [{"stage": "pretrain", "name": "../elsewhere"}]})
