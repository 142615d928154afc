"""The CLI on bad input: one clear line naming what, where and what was expected; exit 2; nothing half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from posttrain.cli import app
from conftest import tiny_recipe_dict

runner = CliRunner()


def _recipe(tmp_path: Path, **over) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe_dict(**over)))
    return path


def _sft_file(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _with_sft_data(tmp_path: Path, data_path: Path) -> Path:
    d = tiny_recipe_dict()
    d["stages"][1]["data"] = [{"path": str(data_path)}]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def _fails(args: list[str], *needles: str) -> str:
    result = runner.invoke(app, args, env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    for needle in needles:
        assert needle in text, text
    return text


GOOD = json.dumps({"messages": [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"}]})


@pytest.mark.parametrize(
    ("lines", "needles"),
    [
        ([GOOD, "{not json"], ["sft.jsonl:2", "JSON"]),
        ([GOOD, json.dumps({"prompt": "What is 1+1?"})], ["sft.jsonl:2", "completion"]),
        ([json.dumps({"messages": "hello"})], ["sft.jsonl:1", "messages"]),
        ([], ["sft.jsonl", "empty"]),
    ],
)
def test_bad_data_file(tmp_path, lines, needles):
    out = tmp_path / "run"
    _fails(["run", str(_with_sft_data(tmp_path, _sft_file(tmp_path, lines))), "--out", str(out)], *needles)
    assert not out.exists()  # validation happens before the run folder is made


def test_missing_data_file(tmp_path):
    out = tmp_path / "run"
    _fails(["run", str(_with_sft_data(tmp_path, tmp_path / "nope.jsonl")), "--out", str(out)], "nope.jsonl")
    assert not out.exists()


def test_prompt_longer_than_the_context(tmp_path):
    long = json.dumps({"prompt": "What is " + "1+" * 200 + "1?", "completion": "201"})
    recipe = _with_sft_data(tmp_path, _sft_file(tmp_path, [GOOD, long]))
    _fails(["run", str(recipe), "--out", str(tmp_path / "run")], "sft.jsonl:2", "max_len")
    assert not (tmp_path / "run").exists()  # found before anything was written


def test_unknown_key_and_invalid_values(tmp_path):
    d = tiny_recipe_dict()
    d["stages"][0]["lerning_rate"] = 1
    d["stages"][0]["optim"]["lr"] = -0.1
    d["stages"][1]["batch_size"] = 0
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(d))
    text = _fails(["run", str(path), "--out", str(tmp_path / "run")],
                  "r.yaml: stages[0].lerning_rate: unknown key", "stages[0].optim.lr: Input should be greater than 0",
                  "stages[1].batch_size")
    assert "Traceback" not in text
    assert not (tmp_path / "run").exists()


def test_bad_override_and_missing_recipe(tmp_path):
    _fails(["run", str(_recipe(tmp_path)), "stages.0.steps=-3", "--out", str(tmp_path / "run")], "stages[0].steps")
    _fails(["run", str(tmp_path / "missing.yaml")], "missing.yaml", "does not exist")


def test_resume_from_a_folder_that_is_not_a_run(tmp_path):
    """--resume never clears a folder posttrain did not write (an empty or missing one just starts the run)."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    _fails(["run", str(_recipe(tmp_path)), "--out", str(tmp_path / "mine"), "--resume"], "not a posttrain run folder")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_changed_recipe_is_refused_naming_the_key(tmp_path):
    from posttrain.runtime.recipe_file import dump_recipe, load_recipe

    path = _recipe(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.yaml").write_text(dump_recipe(load_recipe(path, [])))  # killed before any checkpoint
    for resume in ([], ["--resume"]):
        _fails(["run", str(path), "stages.1.steps=10", "--out", str(tmp_path / "run"), *resume],
               "run/recipe.yaml: this folder was run with a different recipe, first at stages.1.steps (folder: 8, now: 10)")
