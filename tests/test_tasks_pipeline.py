"""A user's model, files and evals end to end: recipes/smollm2-own-data.yaml on SmolLM2-135M-Instruct,
with the arithmetic world made impossible to build. The evals after each stage are exactly the
recipe's; the report renders. The default run is a 1-step-per-stage variant on a 4-pair DPO file;
the shipped recipe as written is the slow test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.pipeline.run import run_pipeline
from posttrain.runtime.recipe_file import load_recipe
from posttrain.tasks.arithmetic import ArithmeticTask
from posttrain.worlds.arithmetic import ArithmeticWorld

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "smollm2-own-data.yaml"


@pytest.fixture
def no_world(monkeypatch):
    """Building the arithmetic world, or even its task, fails the test."""
    def boom(self, *a, **k):
        raise AssertionError(f"{type(self).__name__} constructed in a run that never names the arithmetic task")

    monkeypatch.setattr(ArithmeticWorld, "__init__", boom)
    monkeypatch.setattr(ArithmeticTask, "__init__", boom)


def run_smollm2(tmp_path: Path, monkeypatch, smollm2, overrides: list[str]) -> Path:
    monkeypatch.chdir(ROOT)  # the recipe's data paths are relative to the repository root
    assert smollm2.is_dir()  # the fixture builds the cached folder `model.init: smollm2-135m-instruct` resolves to
    recipe = load_recipe(RECIPE, overrides)
    assert recipe.task_names() == []  # files only: no task named
    run_dir = tmp_path / "run"
    run_pipeline(recipe, run_dir)
    return run_dir


def check_run(run_dir: Path, per_level: int) -> None:
    evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    # exactly the recipe's one eval, on the loaded start and after every stage: greedy pass@1 per level + pooled
    assert {e["eval"] for e in evals} == {"add2"}
    assert [e["stage"] for e in evals[::3]] == ["base", "sft", "dpo", "grpo"]
    assert {(e["level"], e["metric"]) for e in evals} == {("no_carry", "pass@1"), ("carry", "pass@1"), (None, "pass@1")}
    assert all(e["n"] == (2 * per_level if e["level"] is None else per_level) for e in evals)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {m["stage"] for m in metrics} == {"sft", "dpo", "grpo"}
    assert not any(k.startswith(("gold/", "eval/h2h")) for m in metrics for k in m)  # no gold judge: omitted, not faked
    from posttrain.report import write_report

    html = write_report(run_dir).read_text()
    assert "add2" in html


@pytest.mark.heavy  # 56 s; the same recipe runs as shipped in the default run (below)
def test_smollm2_own_data_one_step_per_stage(tmp_path, monkeypatch, smollm2, no_world):
    pairs = (ROOT / "recipes/data/smollm2/dpo.jsonl").read_text().splitlines()[:4]
    (tmp_path / "dpo4.jsonl").write_text("\n".join(pairs) + "\n")
    run_dir = run_smollm2(tmp_path, monkeypatch, smollm2, [
        "telemetry.measure_cpu=false",  # the CPU roofline measurement is telemetry's (minutes on a loaded machine)
        "evals.0.per_level=1", "evals.0.batch_size=4", "evals.0.max_new_tokens=3",
        "stages.0.steps=1", "stages.0.batch_size=2", "stages.0.save_every=1", "stages.0.log_every=1",
        f"stages.1.data.0.path={tmp_path / 'dpo4.jsonl'}", "stages.1.steps=1", "stages.1.batch_size=2", "stages.1.save_every=1",
        "stages.2.steps=1", "stages.2.batch_size=4", "stages.2.group_size=2", "stages.2.save_every=1", "stages.2.max_new_tokens=3"])
    check_run(run_dir, per_level=1)
    from posttrain.report import write_report

    open_in_browser(write_report(run_dir), tmp_path / "report-smollm2.png")


def open_in_browser(report: Path, shot: Path) -> None:
    """The report in headless chromium (tests/test_report_browser.py's setup): no console error, every chart drawn."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no `playwright install`)")
    from test_report_browser import ARGS, CHROMIUM, _charts_drawn, _open

    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found: apt-get install -y chromium")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        page, errors = _open(browser, report, shot.parent)
        drawn = _charts_drawn(page)
        assert "evals-fig" in [i for i, _ in drawn] and all(n > 0 for _, n in drawn), drawn
        assert page.locator(".node .node-name").all_inner_texts()[1:] == ["sft", "dpo", "grpo"]
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert errors == []


@pytest.mark.slow
def test_smollm2_own_data_recipe_as_shipped(tmp_path, monkeypatch, smollm2, no_world):
    run_dir = run_smollm2(tmp_path, monkeypatch, smollm2, [])
    recipe = load_recipe(RECIPE)
    check_run(run_dir, per_level=recipe.evals[0].per_level or 0)
    from posttrain.report import write_report

    open_in_browser(write_report(run_dir), tmp_path / "report-smollm2.png")
