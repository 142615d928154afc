"""Rounds: a block of stages repeated N times, expanded into ordinary stages named `r<k>.<name>`
(docs/rounds.md); and every stage logging under its own name, which rounds rely on."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import metric_rows, start_run, tiny_recipe_dict
from posttrain.cli import app
from posttrain.pipeline.run import run_pipeline
from posttrain.report import write_report
from posttrain.runtime.config import Recipe, RecipeError
from posttrain.runtime.recipe_file import dump_recipe, load_recipe
from posttrain.runtime.rounds import expand_rounds
from posttrain.stages import rejection_sampling as rs_mod

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


# ---- a tiny 2-round run ------------------------------------------------------------------------
def two_round_recipe(run_dir: Path) -> dict:
    """pretrain → SFT → 2 rounds of {rejection sampling → SFT on the kept → DPO on the pairs}, tiny.

    The policy is near-random after 6 steps, so the round scores by a length reward (always judged,
    different between replies, −len/128) with min_reward −1: the test is about the loop, not the gain."""
    d = tiny_recipe_dict(threads=1, telemetry={"measure_cpu": False},
                         evals=[{"task": "arithmetic", "per_level": 2, "levels": ["L1"], "max_new_tokens": 8,
                                 "batch_size": 8, "probe": False}])
    d["stages"][0].update(steps=2, save_every=2)
    d["stages"][1].update(steps=4, save_every=2, heldout=4)
    files = f"{run_dir}/rounds/{{round}}"
    d["stages"].append({"rounds": {"repeat": 2, "stages": [
        {"stage": "rejection_sampling", "data": [{"task": "arithmetic", "n": 24}], "draw": "{round}", "samples": 16,
         "batch_prompts": 8, "max_new_tokens": 48, "min_reward": -1.0, "pairs": True,
         "rewards": [{"name": "length", "params": {"max_len": 128, "count": "chars"}}],
         "output": f"{files}/sft.jsonl", "pairs_output": f"{files}/pairs.jsonl"},
        {"stage": "sft", "steps": 2, "batch_size": 4, "max_len": 96, "heldout": 0, "save_every": 1, "log_every": 1,
         "data": [{"path": f"{files}/sft.jsonl"}], "optim": {"lr": 1e-3, "warmup_steps": 1}},
        {"stage": "dpo", "steps": 2, "batch_size": 4, "max_len": 96, "eval_per_level": 0, "save_every": 1, "log_every": 1,
         "data": [{"path": f"{files}/pairs.jsonl"}], "optim": {"lr": 1e-4, "warmup_steps": 1}},
    ]}})
    return d


ROUND_STAGES = [f"r{k}.{s}" for k in (1, 2) for s in ("rejection_sampling", "sft", "dpo")]
DATA_FILES = [f"rounds/{k}/{f}.jsonl" for k in (1, 2) for f in ("sft", "pairs")]


def _weights(run_dir: Path, stage: str) -> dict:
    return load_file(run_dir / "checkpoints" / stage / "final" / "model.safetensors")


def _same_run(a: Path, b: Path) -> None:
    """The same data files, byte for byte, and the same final weights of every stage, bit for bit."""
    for f in DATA_FILES:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    for stage in ["pretrain", "sft", *ROUND_STAGES]:
        wa, wb = _weights(a, stage), _weights(b, stage)
        assert all(bool((wa[k] == wb[k]).all()) for k in wa), stage


@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("rounds") / "run"
    run_pipeline(Recipe.model_validate(two_round_recipe(run_dir)), run_dir)
    return run_dir


def test_two_rounds_run_as_ordinary_stages(two_rounds):
    for stage in ROUND_STAGES:
        assert (two_rounds / "checkpoints" / stage / "final" / "manifest.json").is_file(), stage
    metrics = _jsonl(two_rounds / "metrics.jsonl")
    for stage in ("r1.sft", "r1.dpo", "r2.sft", "r2.dpo"):
        assert [m["step"] for m in metrics if m["stage"] == stage] == [1, 2], stage
    assert {m["stage"] for m in metrics if "rs/pairs" in m} == {"r1.rejection_sampling", "r2.rejection_sampling"}
    # evals after every stage; a copy's rows carry its round, a plain stage's null
    evals = _jsonl(two_rounds / "evals.jsonl")
    assert {(e["stage"], e["round"]) for e in evals} == {("pretrain", None), ("sft", None)} | {
        (s, int(s[1])) for s in ROUND_STAGES}
    # round 2 samples from round 1's last model: its (unchanged) policy checkpoint is r1.dpo's weights
    assert _weights(two_rounds, "r2.rejection_sampling").keys() == _weights(two_rounds, "r1.dpo").keys()
    assert all(bool((v == _weights(two_rounds, "r1.dpo")[k]).all()) for k, v in _weights(two_rounds, "r2.rejection_sampling").items())
    # each round collected its own data, from other prompts (draw: {round})
    r1, r2 = (_jsonl(two_rounds / f"rounds/{k}/sft.jsonl") for k in (1, 2))
    assert r1 and r2 and not {json.dumps(r["messages"][:-1]) for r in r1} & {json.dumps(r["messages"][:-1]) for r in r2}
    assert all(_jsonl(two_rounds / f"rounds/{k}/pairs.jsonl") for k in (1, 2))


def test_report_doctor_and_phases_read_dotted_stage_names(two_rounds):
    assert json.loads((two_rounds / "doctor.json").read_text())["findings"] is not None
    html = write_report(two_rounds).read_text()
    assert all(stage in html for stage in ROUND_STAGES)
    out = CliRunner().invoke(app, ["phases", str(two_rounds)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert all(f"stage {stage}:" in out.output for stage in ROUND_STAGES)


class Killed(Exception):
    pass


def test_killed_inside_round_2s_collect_resumes_to_the_same_files(two_rounds, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    recipe = Recipe.model_validate(two_round_recipe(run_dir))
    real = rs_mod.best_and_worst

    def dies_in_round_2(*args, **kw):  # round 2's collect, after it has judged its first prompt
        if (run_dir / "checkpoints" / "r1.dpo" / "final").is_dir():
            raise Killed
        return real(*args, **kw)

    monkeypatch.setattr(rs_mod, "best_and_worst", dies_in_round_2)
    with pytest.raises(Killed):
        run_pipeline(recipe, run_dir)
    monkeypatch.setattr(rs_mod, "best_and_worst", real)
    assert not (run_dir / "rounds" / "2").exists() and (run_dir / "rounds" / "1" / "pairs.jsonl").is_file()
    run_pipeline(recipe, run_dir, resume=True)
    _same_run(run_dir, two_rounds)
    assert sorted(metric_rows(run_dir)) == sorted(metric_rows(two_rounds))
    # batch 1 of 3 (8 of 24 prompts) was judged and journaled before the kill: replayed, not judged again
    assert _collect_counts(run_dir) == (1.0, 2.0, [2, 3])
    assert _collect_counts(two_rounds) == (0.0, 3.0, [1, 2, 3])


def _collect_counts(run_dir: Path, stage: str = "r2.rejection_sampling") -> tuple[float, float, list[int]]:
    """Round 2's collect: (batches replayed from the journal, batches judged, the steps of its `score`
    phases in phases.jsonl — one per batch judged in the run that finished it)."""
    summary = [m for m in _jsonl(run_dir / "metrics.jsonl") if m["stage"] == stage and "rs/rows" in m][-1]
    scored = [p["step"] for p in _jsonl(run_dir / "phases.jsonl") if p["stage"] == stage and p["name"] == "score"]
    return summary["rs/batches_replayed"], summary["rs/batches_judged"], scored


@pytest.mark.slow
def test_sigkill_inside_round_2s_collect_resumes_to_the_same_files(two_rounds, tmp_path):
    """A real process killed (SIGKILL) while round 2 collects — after its first generation call's row,
    before its files are written — and resumed with --resume ends with the data files and weights of
    the uninterrupted run."""
    run_dir = tmp_path / "run"
    recipe = tmp_path / "rounds.yaml"
    recipe.write_text(yaml.safe_dump(two_round_recipe(run_dir)))

    journal = run_dir / "journal" / "r2.rejection_sampling.jsonl"
    proc, deadline = start_run(recipe, run_dir), time.time() + 900
    while not (journal.is_file() and journal.read_bytes().count(b"\n") >= 2):  # header + batch 1 judged
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "round 2's collect never judged a batch"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "rounds" / "2" / "sft.jsonl").exists()  # killed inside the collect step
    judged = journal.read_bytes().count(b"\n") - 1
    assert 1 <= judged < 3, f"the kill landed after {judged} of 3 batches"
    with journal.open("ab") as f:  # what a kill in the middle of the next batch's write leaves
        f.write(b'{"step": %d, "texts": ["12' % (judged + 1))
    resumed = start_run(recipe, run_dir, resume=True)
    _, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err[-3000:]
    _same_run(run_dir, two_rounds)
    assert sorted(metric_rows(run_dir)) == sorted(metric_rows(two_rounds))
    # the journaled batches were neither generated nor judged again; the torn one was judged once more
    assert _collect_counts(run_dir) == (float(judged), float(3 - judged), list(range(judged + 1, 4)))
