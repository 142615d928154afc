"""Every shipped recipe runs end to end, shrunk to a few steps per stage: the recipe's own stages, data
sources, hand-offs (r1's rejection-sampling file, instructgpt's reward model, rlvr-arithmetic's start
checkpoint, llama3's rounds) and evals — only sizes change (and llama3's collect scoring, see below). A recipe whose syntax or hand-off rots fails here, in the
default run, not in a user's first minute. The full-size runs are measured in the issue notes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.pipeline.run import run_pipeline
from posttrain.runtime.recipe_file import load_recipe

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
# The smollm2 recipe needs the real checkpoint: tests/test_tasks_pipeline.py runs it (shrunk and as shipped);
# the *-smollm2 variants of the published recipes run shrunk below (test_smollm2_variant_runs_end_to_end).
SHIPPED = sorted(p.stem for p in RECIPES.glob("*.yaml") if p.stem != "smollm2-own-data")

# A field present in a stage is shrunk to this; everything else stays as the recipe wrote it.
SMALL: dict[str, int] = {
    "steps": 2, "save_every": 2, "log_every": 1, "batch_size": 4, "documents": 200, "seq_len": 32,
    "heldout": 8, "norm_samples": 8, "samples_per_prompt": 2, "eval_per_level": 2, "eval_every": 2,
    "max_new_tokens": 8, "samples": 2, "batch_prompts": 4, "minibatch_size": 2, "warmup_steps": 1,
}


def shrink_stage(at: str, st: dict[str, Any]) -> list[str]:
    """Overrides that cut the stage written at key path `at` (`stages.3`) to a few steps and examples."""
    out = []
    group = st.get("group_size")
    for key, value in SMALL.items():
        if key == "batch_size" and group:
            out.append(f"{at}.batch_size={2 * group}")  # two prompts' groups
        elif key == "warmup_steps" and "optim" in st:
            out.append(f"{at}.optim.warmup_steps=1")
        elif key in st:
            out.append(f"{at}.{key}={value}")
    if st.get("stage") == "rejection_sampling":
        # A few steps of training solve nothing, so nothing would reach the recipe's bar and the stage
        # rightly refuses to write an empty file; keep every sample so the hand-off itself is exercised.
        out.append(f"{at}.min_reward=-1e9")
    for j, src in enumerate(st.get("data", [])):
        if "n" in src:
            out.append(f"{at}.data.{j}.n=64")
    for j, src in enumerate(st.get("rankings", [])):
        if "n" in src:
            out.append(f"{at}.rankings.{j}.n=16")
    return out


def shrink(raw: dict[str, Any]) -> list[str]:
    """Overrides (`key=value`) that cut every stage and eval of a recipe to a few steps and examples;
    a rounds block keeps its `repeat`, the stages inside it are cut."""
    out = ["telemetry.measure_cpu=false", "threads=1"]
    for i, ev in enumerate(raw.get("evals", [])):
        out += [f"evals.{i}.per_level=2", f"evals.{i}.max_new_tokens=8"]
    for i, st in enumerate(raw["stages"]):
        if "rounds" in st:
            for j, inner in enumerate(st["rounds"]["stages"]):
                out += shrink_stage(f"stages.{i}.rounds.stages.{j}", inner)
        else:
            out += shrink_stage(f"stages.{i}", st)
    return out


def run_shrunk(name: str, run_root: Path, extra: list[str] = ()) -> Path:
    raw = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    recipe = load_recipe(RECIPES / f"{name}.yaml", shrink(raw) + list(extra))
    run_dir = run_root / "runs" / name  # r1's hand-off file is written under runs/r1/, relative to the cwd
    run_pipeline(recipe, run_dir)
    return run_dir


def check(run_dir: Path, stages: list[str]) -> None:
    for stage in stages:
        assert (run_dir / "checkpoints" / stage / "final" / "manifest.json").is_file(), stage
    evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert set(stages) <= {e["stage"] for e in evals}  # the recipe's evals ran after every stage
    # every checkpoint after the first evaluated carries its bisect marks against the one before it
    first = evals[0]["stage"]
    assert all(e["moved"] in ("up", "down", "none", "unknown") and e["vs"] for e in evals if e["stage"] != first)
    doctor = json.loads((run_dir / "doctor.json").read_text())
    assert "findings" in doctor
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = {m["stage"] for m in metrics}
    assert trained, "no stage logged a metric"


def test_every_shipped_recipe_validates_and_names_its_command():
    assert set(SHIPPED) >= {"quickstart", "instructgpt", "r1", "r1-zero", "rlvr-arithmetic", "llama3", "tools-arithmetic",
                            "tulu3", "qwen2.5"}
    for name in SHIPPED + ["smollm2-own-data"]:
        path = RECIPES / f"{name}.yaml"
        load_recipe(path)
        first = path.read_text().splitlines()[0]
        assert first.startswith("# posttrain ") and ("run recipes/" in first or "demo" in first), (name, first)


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shipped")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        return run_shrunk("quickstart", root)


def test_quickstart_the_demo(quickstart_run):
    check(quickstart_run, ["pretrain", "sft", "dpo", "grpo"])


def test_rlvr_arithmetic_from_the_demo_sft(quickstart_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = run_shrunk("rlvr-arithmetic", tmp_path,
                         [f"model.init={quickstart_run / 'checkpoints' / 'sft' / 'final'}"])
    check(run_dir, ["grpo"])


def test_tools_arithmetic_episodes_in_the_tasks_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = run_shrunk("tools-arithmetic", tmp_path)
    check(run_dir, ["pretrain", "sft", "grpo"])
    grpo = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"grpo"' in x]
    assert grpo and all("episode/tool_use_frac" in m for m in grpo)  # GRPO played episodes in the task's environment
    evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert {(e["eval"], e["metric"]) for e in evals} == {("arithmetic-tools", "exact_match"), ("arithmetic-tools", "tool_use")}


def test_code_tools_episodes_with_hidden_tests(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = run_shrunk("code-tools", tmp_path)
    check(run_dir, ["grpo"])
    grpo = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"grpo"' in x]
    keys = {"episode/tool_calls_mean", "episode/tool_errors", "tool/hidden_probe", "tool/hidden_probe_frac", "reward/env"}
    assert len(grpo) == 2 and all(keys <= set(m) for m in grpo)  # each step logged its episodes' tools and probes
    evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert {(e["eval"], e["metric"]) for e in evals} == {("code-tools", "pass"), ("code-tools", "tool_use")}


# llama3's rounds collect with the gold judge at min_reward 0.9, which a policy trained 4 steps never
# reaches (and it rarely ends a turn in 8 tokens): shrunk, each round's collect scores by length
# (always judged, different between replies) with min_reward −1 and 8 samples of up to 32 tokens, so
# its SFT rows and best-vs-worst pairs exist and the loop's hand-offs run.
LLAMA3_COLLECT = "stages.2.rounds.stages.0"
LLAMA3_SHRUNK = [f"{LLAMA3_COLLECT}.min_reward=-1", f"{LLAMA3_COLLECT}.pair_margin=0", f"{LLAMA3_COLLECT}.samples=8",
                 f"{LLAMA3_COLLECT}.max_new_tokens=32",
                 f"{LLAMA3_COLLECT}.rewards=[{{name: length, params: {{max_len: 128, count: chars}}}}]"]


# tulu3's and qwen2.5's on-policy collect steps, shrunk, the same way: scored by length so pairs exist.
def collect_shrunk(at: str) -> list[str]:
    return [f"{at}.min_reward=-1", f"{at}.pair_margin=0", f"{at}.samples=8", f"{at}.max_new_tokens=32",
            f"{at}.rewards=[{{name: length, params: {{max_len: 128, count: chars}}}}]"]


@pytest.mark.slow
@pytest.mark.parametrize("name, stages, extra", [
    ("tulu3", ["pretrain", "sft", "prefs", "dpo", "rlvr"], collect_shrunk("stages.2")),
    ("qwen2.5", ["pretrain", "sft", "offline_prefs", "offline_dpo", "reward_model", "online_rl"], collect_shrunk("stages.2")),
    ("r1-zero", ["pretrain", "grpo"], []),
    ("instructgpt", ["pretrain", "sft", "reward_model", "ppo"], []),
    ("r1", ["pretrain", "sft", "grpo", "rejection_sampling", "sft_rs", "grpo2"], []),
    ("llama3", ["pretrain", "sft"] + [f"r{k}.{s}" for k in (1, 2, 3) for s in ("rejection_sampling", "sft", "dpo")],
     LLAMA3_SHRUNK),
])
def test_shipped_recipe_runs_end_to_end(name, stages, extra, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = run_shrunk(name, tmp_path, extra)
    check(run_dir, stages)
    if name == "qwen2.5":  # the online RL stage summed the reward model with the rule rewards
        rl = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"online_rl"' in x]
        scored = [m for m in rl if "reward/total" in m]
        assert scored and all({"reward/reward_model", "reward/math", "reward/format"} <= set(m) for m in scored)
    if name == "llama3":  # each round's data under runs/llama3/rounds/<k>/, its eval rows carry the round
        assert all((run_dir / "rounds" / str(k) / f).is_file() for k in (1, 2, 3) for f in ("sft.jsonl", "pairs.jsonl"))
        evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
        assert {(e["stage"], e["round"]) for e in evals} >= {("sft", None), ("r3.dpo", 3)}


# The distillation experiment, shrunk: the teacher, then the student SFT'd on its traces (the
# collect step scored by length, as llama3's above: a teacher trained 2 steps rarely ends a turn, let
# alone correctly), then the RL arm from the distillation run's pretrained student. Each later recipe
# names the earlier run's folder relative to the working directory, as shipped.
DISTILL_COLLECT = "stages.1"
DISTILL_SHRUNK = [f"{DISTILL_COLLECT}.samples=8", f"{DISTILL_COLLECT}.max_new_tokens=32",
                  f"{DISTILL_COLLECT}.rewards=[{{name: length, params: {{max_len: 128, count: chars}}}}]"]


@pytest.mark.slow
def test_r1_distill_teacher_student_and_rl_arm(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check(run_shrunk("r1-distill-teacher", tmp_path), ["pretrain", "sft", "grpo"])
    student = run_shrunk("r1-distill", tmp_path, DISTILL_SHRUNK)
    check(student, ["pretrain", "distill_collect", "distill_sft"])
    assert (student / "journal" / "distill_collect.jsonl").is_file()
    rl = run_shrunk("r1-distill-rl", tmp_path)
    check(rl, ["sft", "grpo"])
    # both arms start from the same pretrained student: the RL arm's base eval is the distillation run's pretrain eval
    evals = {r: [json.loads(x) for x in (d / "evals.jsonl").read_text().splitlines()] for r, d in (("s", student), ("r", rl))}
    strip = lambda rows, st: [(e["level"], e["metric"], e["value"]) for e in rows if e["stage"] == st]  # noqa: E731
    assert strip(evals["r"], "base") == strip(evals["s"], "pretrain") != []


# The published recipes' SmolLM2 variants, shrunk: the real checkpoint (offline, the `smollm2` fixture), the
# recipe's data files cut to 8 rows (in the working directory, where the run's relative paths resolve),
# each collect step scored by length over 8 samples at T = 1 (SmolLM2 answers most sums right and alike, so the exact
# answer alone, or 2 samples, would leave a prompt's samples with no pair between them).
def smollm2_collect(at: str) -> list[str]:
    return [f"{at}.min_reward=-1", f"{at}.pair_margin=0", f"{at}.samples=8", f"{at}.temperature=1.0", f"{at}.max_new_tokens=16",
            f"{at}.rewards=[{{name: length, params: {{max_len: 64, count: chars}}}}]"]


@pytest.mark.slow
@pytest.mark.heavy  # 2–9 minutes each on this CPU: `pytest -m heavy tests/test_shipped_recipes.py`
@pytest.mark.parametrize("name, stages, extra", [
    ("qwen2.5-smollm2", ["sft", "offline_prefs", "offline_dpo", "reward_model", "online_rl"], smollm2_collect("stages.1")),
    ("tulu3-smollm2", ["sft", "prefs", "dpo", "rlvr"], smollm2_collect("stages.1")),
    ("llama3-smollm2", ["sft"] + [f"r{k}.{s}" for k in (1, 2) for s in ("rejection_sampling", "sft", "dpo")],
     smollm2_collect("stages.1.rounds.stages.0")),
    ("r1-distill-smollm2", ["pretrain", "distill_collect", "distill_sft"],
     [x for x in smollm2_collect("stages.1") if "pair_margin" not in x]),
])
def test_smollm2_variant_runs_end_to_end(name, stages, extra, smollm2, tmp_path, monkeypatch):
    assert smollm2.is_dir()  # the cached folder `smollm2-135m-instruct` resolves to
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "recipes" / "data" / "smollm2"  # the recipe's files, cut to their first 8 rows each
    data.mkdir(parents=True)
    for f in (RECIPES / "data" / "smollm2").glob("*.jsonl"):
        (data / f.name).write_text("".join(f.read_text().splitlines(keepends=True)[:8]))
    run_dir = run_shrunk(name, tmp_path, extra)
    check(run_dir, stages)
    evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert {e["eval"] for e in evals} == {"add2"}
