"""Resume trusts only checkpoints that verify: damage is named in one line, the damaged checkpoint is set
aside, and the run continues from the newest good one to final weights bitwise equal to an
uninterrupted run — or stops in one line when no checkpoint of the run verifies.

The "killed" run is the uninterrupted one with `sft/final` removed: exactly what a kill after SFT's
last step leaves (step-000003 and step-000006 published, metric rows logged up to step 8).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from safetensors.torch import load_file

from conftest import tiny_recipe_dict
from posttrain.pipeline.resume import RunError, inspect_run_dir
from posttrain.pipeline.run import run_pipeline
from posttrain.runtime.checkpoint import CheckpointError, verify_checkpoint
from posttrain.runtime.config import Recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def _recipe(**over) -> Recipe:
    return Recipe.model_validate(tiny_recipe_dict(threads=1, telemetry={"measure_cpu": False}, **over))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    run_pipeline(_recipe(), out, console=Console(quiet=True))
    return out


def _weights(run: Path, stage: str = "sft") -> dict:
    return load_file(run / "checkpoints" / stage / "final" / "model.safetensors")


def _killed_copy(reference: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / "sft" / "final")
    return run


def _resume(run: Path) -> str:
    console = Console(record=True, width=400)
    run_pipeline(_recipe(), run, resume=True, console=console)
    return console.export_text()


def _assert_same_run(run: Path, reference: Path) -> None:
    ref, got = _weights(reference), _weights(run)
    assert got.keys() == ref.keys()
    for name, tensor in ref.items():
        assert bool((got[name] == tensor).all()), f"{name} differs from the uninterrupted run"
    rows = [(r["stage"], r["step"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    ref_rows = [(r["stage"], r["step"]) for r in map(json.loads, (reference / "metrics.jsonl").read_text().splitlines())]
    assert sorted(rows) == sorted(ref_rows) and len(rows) == len(set(rows))


def _cut(path: Path, keep: float) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated weights": (lambda c: _cut(c / "model.safetensors", 0.5), "model.safetensors: "),
    "truncated trainer state": (lambda c: _cut(c / "trainer_state.pt", 0.3), "trainer_state.pt: "),
    "deleted file": (lambda c: (c / "tokenizer.json").unlink(), "tokenizer.json: missing"),
    "flipped byte": (lambda c: _flip(c / "model.safetensors"), "model.safetensors: content differs"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(reference, tmp_path, damage):
    run = _killed_copy(reference, tmp_path)
    newest = run / "checkpoints" / "sft" / "step-000006"
    spoil, named = DAMAGE[damage]
    spoil(newest)
    text = _resume(run)
    line = next(ln for ln in text.splitlines() if "set aside" in ln)
    assert line.startswith(f"checkpoints/sft/step-000006: {named}"), line
    assert "resuming sft from step-000003" in text               # the previous good checkpoint
    assert (run / "checkpoints" / "sft" / ".corrupt-step-000006").is_dir()
    _assert_same_run(run, reference)
    assert verify_checkpoint(run / "checkpoints" / "sft" / "final") == []


def test_a_damaged_final_is_not_skipped_as_done(reference, tmp_path):
    """pretrain/final cut short: pretrain is not done, it re-runs from step-000006 and writes a final equal
    to the old one; SFT's final verifies and stays done."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    _cut(run / "checkpoints" / "pretrain" / "final" / "model.safetensors", 0.5)
    text = _resume(run)
    assert "checkpoints/pretrain/final: model.safetensors:" in text and "resuming pretrain from step-000006" in text
    assert "sft: done, skipping" in text
    for stage in ("pretrain", "sft"):
        ref, got = _weights(reference, stage), _weights(run, stage)
        assert all(bool((got[k] == v).all()) for k, v in ref.items()), stage
    _assert_same_run(run, reference)


def test_a_damaged_base_is_built_again_identically(reference, tmp_path):
    run = _killed_copy(reference, tmp_path)
    _flip(run / "checkpoints" / "base" / "final" / "model.safetensors")
    text = _resume(run)
    assert "checkpoints/base/final: model.safetensors: content differs from the manifest" in text
    assert "built from scratch" in text                                # make_base ran again
    ref, got = _weights(reference, "base"), _weights(run, "base")
    assert all(bool((got[k] == v).all()) for k, v in ref.items())
    _assert_same_run(run, reference)


def test_no_checkpoint_that_verifies_stops_in_one_line(reference, tmp_path):
    run = _killed_copy(reference, tmp_path)
    for manifest in (run / "checkpoints").glob("*/*/manifest.json"):
        manifest.unlink()
    with pytest.raises(CheckpointError) as e:
        inspect_run_dir(run, _recipe(), resume=True, fresh=False)
    msg = str(e.value)
    assert "\n" not in msg and "none of its 6 checkpoints verifies" in msg and "manifest.json: missing" in msg
    # base/final, pretrain step-000003, step-000006, final, sft step-000003, step-000006 = 6


def test_a_different_recipe_is_refused_naming_the_first_differing_key(reference, tmp_path):
    run = _killed_copy(reference, tmp_path)
    d = _recipe().model_dump(mode="json")
    d["stages"][1]["steps"] = 10
    changed = Recipe.model_validate(d)
    for resume in (True, False):
        with pytest.raises(RunError, match=r"recipe.yaml: this folder was run with a different recipe, first at "
                                           r"stages\.1\.steps \(folder: 8, now: 10\)"):
            inspect_run_dir(run, changed, resume=resume, fresh=False)
    with pytest.raises(RunError, match="already holds a run; pass --resume"):  # same recipe, no --resume
        inspect_run_dir(run, _recipe(), resume=False, fresh=False)


def test_resume_before_any_checkpoint_starts_over_with_the_same_recipe(tmp_path):
    """Killed after recipe.yaml was written, before base/final was published."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(yaml.safe_dump(_recipe().model_dump(mode="json"), sort_keys=False))
    (run / "checkpoints" / "base").mkdir(parents=True)
    (run / "checkpoints" / "base" / ".tmp-final-123").mkdir()      # the kill's half-written base
    plan = inspect_run_dir(run, _recipe(), resume=True, fresh=False)
    assert plan.clear and not plan.resume and "before its first checkpoint was published" in plan.note
    d = {**_recipe().model_dump(mode="json"), "seed": 1}
    with pytest.raises(RunError, match=r"first at seed \(folder: 0, now: 1\)"):
        inspect_run_dir(run, Recipe.model_validate(d), resume=True, fresh=False)
    # nothing there yet (killed in its first second): the run starts
    assert not inspect_run_dir(tmp_path / "absent", _recipe(), resume=True, fresh=False).clear
    other = tmp_path / "not-a-run"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match="not a posttrain run folder"):  # never cleared
        inspect_run_dir(other, _recipe(), resume=True, fresh=False)


def test_posttrain_verify_prints_a_table_and_exits_2_on_a_failure(reference, tmp_path):
    from typer.testing import CliRunner

    from posttrain.cli import app

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    ok = CliRunner().invoke(app, ["verify", str(run)], env={"COLUMNS": "300"})
    # base/final + pretrain (step-000003, step-000006, final) + sft (the same three) = 1 + 3 + 3 = 7
    assert ok.exit_code == 0 and "all 7 checkpoints verify" in ok.output, ok.output
    _flip(run / "checkpoints" / "sft" / "step-000003" / "model.safetensors")
    bad = CliRunner().invoke(app, ["verify", str(run)], env={"COLUMNS": "300"})
    assert bad.exit_code == 2
    row = next(ln for ln in bad.output.splitlines() if "sft/step-000003" in ln)
    assert "model.safetensors: content differs from the manifest" in row
    assert "1 of 7 checkpoints fail verification" in " ".join(bad.output.split())


def test_a_kill_while_the_recipe_is_written_or_the_folder_cleared_still_resumes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".recipe.yaml.tmp").write_text("name: t\nsee")                  # killed before the rename
    plan = inspect_run_dir(run, _recipe(), resume=True, fresh=False)
    assert not plan.clear and "nothing to resume yet" in plan.note
    # killed while clearing a folder to start over: recipe.yaml is removed last, so it still reads as the run
    (run / "recipe.yaml").write_text(yaml.safe_dump(_recipe().model_dump(mode="json"), sort_keys=False))
    (run / "metrics.jsonl").write_text("")
    plan = inspect_run_dir(run, _recipe(), resume=True, fresh=False)
    assert plan.clear and plan.keep_recipe
