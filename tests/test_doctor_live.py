"""The live doctor: rules every N logged records, a finding printed once, `doctor.stop_on` stopping
the run (last good checkpoint named, the reason in doctor.json, exit code 3); `posttrain doctor`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import posttrain.pipeline.run as pipeline_run
from posttrain.cli import DOCTOR_STOP_EXIT, app
from posttrain.doctor import DoctorStop, LiveDoctor, Severity
from posttrain.runtime.config import Recipe
from posttrain.runtime.context import StageResult
from conftest import tiny_recipe_dict

runner = CliRunner()


def records(n: int, nan_at: int | None = None) -> list[dict]:
    return [{"stage": "sft", "step": 10 * i, "loss/sft": float("nan") if i == nan_at else 2.0 - 0.01 * i}
            for i in range(1, n + 1)]


def test_live_prints_once_and_checks_every_n():
    said: list[str] = []
    doc = LiveDoctor(every=2, say=said.append)
    doc.begin("sft", "sft", {})
    for r in records(8, nan_at=3):
        doc.observe(r)
    doc.end()
    # checks after records 2, 4, 6, 8: the NaN (record 3) is first seen at the check after record 4, printed once
    assert doc.cost["sft"].checks == 4
    assert len(said) == 1 and "non_finite" in said[0] and "step 30" in said[0]
    assert doc.cost["sft"].seconds > 0 and doc.cost["sft"].stage_seconds >= doc.cost["sft"].seconds


def test_live_stop_on_critical_and_not_on_warning():
    doc = LiveDoctor(every=1, stop_on=Severity.CRITICAL, say=lambda _: None)
    doc.begin("sft", "sft", {})
    with pytest.raises(DoctorStop) as info:
        for r in records(8, nan_at=3):
            doc.observe(r)
    assert info.value.finding.rule == "non_finite" and info.value.finding.first_step == 30
    doc = LiveDoctor(every=1, stop_on=None, say=lambda _: None)
    doc.begin("sft", "sft", {})
    for r in records(8, nan_at=3):
        doc.observe(r)  # reports, never stops


def test_recipe_doctor_field_validates():
    base = tiny_recipe_dict()
    assert Recipe.model_validate(base).doctor.stop_on is None
    assert Recipe.model_validate({**base, "doctor": {"stop_on": "critical", "every": 3}}).doctor.every == 3
    with pytest.raises(Exception, match="stop_on"):
        Recipe.model_validate({**base, "doctor": {"stop_on": "sometimes"}})


def _nan_stage(cfg, ctx) -> StageResult:
    """A stand-in pretrain stage: a checkpoint folder at step 2, then a NaN loss at step 4."""
    (ctx.stage_dir(cfg.folder) / "step-000002").mkdir(parents=True)
    for step in range(1, cfg.steps + 1):
        ctx.log(cfg.folder, step, {"loss/lm": float("nan") if step >= 4 else 3.0 - 0.1 * step, "train/grad_norm": 1.0})
    raise AssertionError("the doctor should have stopped the stage")


def test_stop_is_clean_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.setitem(pipeline_run.STAGES, "pretrain", _nan_stage)
    d = tiny_recipe_dict(doctor={"stop_on": "critical", "every": 1}, telemetry={"measure_cpu": False})
    d["stages"] = d["stages"][:1]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(d))
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", str(recipe), "--out", str(out)], env={"COLUMNS": "300"})
    assert result.exit_code == DOCTOR_STOP_EXIT == 3, result.output
    assert "stopped:" in result.output and "non_finite" in result.output and "Traceback" not in result.output
    doc = json.loads((out / "doctor.json").read_text())
    assert doc["stopped"]["rule"] == "non_finite" and doc["stopped"]["first_step"] == 4
    assert doc["stopped"]["last_good_checkpoint"] == "checkpoints/pretrain/step-000002"  # saved before step 4
    assert doc["findings"][0]["rule"] == "non_finite" and doc["cost"]["pretrain"]["checks"] == 4
    assert (out / "report.html").is_file()


def test_doctor_command(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(yaml.safe_dump({"stages": [{"stage": "sft", "steps": 80}]}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(8, nan_at=5)))
    result = runner.invoke(app, ["doctor", str(run)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "1 critical" in result.output and "non_finite" in result.output
    assert json.loads((run / "doctor.json").read_text())["findings"][0]["first_step"] == 50
    missing = runner.invoke(app, ["doctor", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "no metrics.jsonl" in missing.output


def test_report_panel_plots_the_evidence(tmp_path):
    from posttrain.doctor import Evidence, Finding
    from posttrain.report import write_report
    from posttrain.report.doctor_panel import evidence_figure
    from test_report import synthetic_run

    run_dir = synthetic_run(tmp_path / "r", rl=False)
    f = Finding("overfitting", "sft", Severity.CRITICAL, 8, "held-out loss rose 12%", "why", "try",
                [Evidence("eval/loss", [2, 4, 6, 8, 10], [1.5, 1.3, 1.2, 1.3, 1.4], (4, 10), 1.2)], "Prechelt 1998")
    (run_dir / "doctor.json").write_text(json.dumps({"findings": [f.to_json()], "stopped": None, "cost": {}}))
    page = write_report(run_dir).read_text()
    assert 'data-fig="doctor-fig-0"' in page and "held-out loss rose 12%" in page and "Prechelt 1998" in page
    fig = evidence_figure(f.to_json())
    rect = next(s for s in fig["layout"]["shapes"] if s["type"] == "rect")
    assert (rect["x0"], rect["x1"]) == (4, 10)  # the triggering window is shaded
    assert any(s["type"] == "line" and s.get("y0") == 1.2 for s in fig["layout"]["shapes"])  # the reference level
    assert fig["data"][0]["y"] == [1.5, 1.3, 1.2, 1.3, 1.4]


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "posttrain" / "recipes" / "failures").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_failure_recipes_validate_and_name_their_command(path, monkeypatch):
    from posttrain.runtime.recipe_file import load_recipe

    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# posttrain run recipes/failures/{path.name}"), first
    recipe = load_recipe(path)
    assert recipe.doctor.stop_on == "critical"
    monkeypatch.chdir(Path(__file__).parent.parent)  # data paths are relative to the repository root
    for stage in recipe.stages:
        for src in getattr(stage, "data", []):
            assert src.path is None or src.path.is_file(), src.path


def test_a_transient_live_finding_stays_in_doctor_json(tmp_path):
    from posttrain.doctor import Finding, write_doctor_json

    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(yaml.safe_dump({"stages": [{"stage": "sft", "steps": 80}]}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(8)))  # healthy now
    seen = Finding("length_explosion", "ppo", Severity.WARNING, 14, "length 20.9 → 31.5", "why", "try")
    _, findings = write_doctor_json(run, live=[seen])
    assert [f.rule for f in findings] == ["length_explosion"] and "seen live" in findings[0].summary


def test_the_false_alarm_check_runs_the_demos_own_dpo_and_grpo_stages():
    # recipes/checks/demo-dpo-grpo.yaml must stay the quickstart's DPO and GRPO stages (and evals) verbatim:
    # the doctor's false-alarm rate over seeds is measured on it (docs/doctor.md, "Measured")
    from posttrain.runtime.recipe_file import load_recipe

    root = Path(__file__).parent.parent / "posttrain" / "recipes"
    quick = yaml.safe_load((root / "quickstart.yaml").read_text())
    check_path = root / "checks" / "demo-dpo-grpo.yaml"
    check = yaml.safe_load(check_path.read_text())
    assert check["stages"] == [quick["stages"][2], quick["stages"][3]] and check["evals"] == quick["evals"]
    assert check_path.read_text().splitlines()[0].startswith("# posttrain run recipes/checks/demo-dpo-grpo.yaml")
    assert [s.stage for s in load_recipe(check_path).stages] == ["dpo", "grpo"]
