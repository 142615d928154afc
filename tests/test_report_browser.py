"""The report in a real browser: Playwright driving Debian's chromium, headless.

Setup (what .ci/run does): `apt-get install -y chromium` and `pip install playwright`; never
`playwright install` (it downloads a browser). Skipped, saying why, when either is missing.

1. A report from a real tiny pretrain + SFT run: no console errors, every chart drawn, no RL section,
   clicking a stage opens its panel (and draws its curves).
2. A report with an RL stage (synthetic records in the documented formats; and a real tiny GRPO run):
   moving the rollout:update slider with the keyboard and reading back the projected cycle average,
   which must equal `posttrain.telemetry.gap` at that ratio.
Each saves a full-page screenshot in its temporary folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import tiny_recipe_dict
from test_report import synthetic_run

from posttrain.report import load_run, write_report
from posttrain.telemetry.gap import gap

CHROMIUM = os.environ.get("POSTTRAIN_CHROMIUM", "/usr/bin/chromium")
# Outside CI a missing browser skips (with the fix); in CI (scripts/test.sh installs both) it fails.
if os.environ.get("CI"):
    import playwright.sync_api as sync_api

    assert Path(CHROMIUM).exists(), f"{CHROMIUM} not found: apt-get install -y chromium"
else:
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no `playwright install`)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found: apt-get install -y chromium", allow_module_level=True)

pytestmark = pytest.mark.slow
ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update",
        "--disable-default-apps", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


def _run(recipe: dict, tmp: Path) -> Path:
    path, out = tmp / "recipe.yaml", tmp / "run"
    path.write_text(yaml.safe_dump(recipe))
    proc = subprocess.run([sys.executable, "-m", "posttrain.cli", "run", str(path), "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    return out


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    """A real pretrain + SFT run, seconds long (tests/conftest.py's tiny recipe on one thread)."""
    return _run(tiny_recipe_dict(threads=1), tmp_path_factory.mktemp("sft"))


def _open(browser, report: Path, shot: Path):
    page = browser.new_page(viewport={"width": 1320, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: errors.append(f"network request {r.url}") if not r.url.startswith("file:") else None)
    page.goto(report.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    return page, errors


def _charts_drawn(page) -> list[tuple[str, int]]:
    """(id, traces drawn) of every chart outside a hidden panel; each must hold Plotly's SVG and a trace."""
    return page.evaluate("""() => Array.from(document.querySelectorAll('.chart[data-fig]'))
        .filter(d => !d.closest('[hidden]'))
        .map(d => [d.id, d.dataset.rendered === '1' && d.querySelector('svg.main-svg') ? d.querySelectorAll('.trace, .scatterlayer .trace').length : -1])""")


def test_sft_run_report_in_browser(browser, sft_run, tmp_path):
    report = write_report(sft_run)
    page, errors = _open(browser, report, tmp_path)
    drawn = _charts_drawn(page)
    ids = [i for i, _ in drawn]
    assert "roofline-fig" in ids and "evals-fig" in ids and "memory-fig" in ids   # memory measured per phase
    assert all(n > 0 for _, n in drawn), drawn                   # every chart drawn, with at least one trace
    assert "This run has no RL stage" in page.locator("#rl").inner_text()   # said, and nothing drawn
    assert page.locator("input.ratio").count() == 0 and page.locator("#rl .chart").count() == 0
    # pipeline: base → pretrain → sft
    assert page.locator(".node .node-name").all_inner_texts() == ["tiny-1m", "pretrain", "sft"]
    page.locator(".node[data-panel='panel-0']").click()           # click pretrain
    page.wait_for_selector("#panel-0 .chart[data-rendered='1'] svg.main-svg", timeout=10_000)
    assert page.locator("#panel-0").is_visible() and not page.locator("#panel-1").is_visible()
    assert page.locator("#panel-0 h3").inner_text() == "pretrain"
    assert "update" in page.locator("#panel-0 table").first.inner_text()   # its phases table
    assert page.locator("#panel-0 .chart .trace").count() >= 3              # loss/lm, train/lr, train/grad_norm…
    page.screenshot(path=str(tmp_path / "report-sft.png"), full_page=True)
    assert (tmp_path / "report-sft.png").stat().st_size > 50_000
    assert errors == []


def _slider_matches_gap(page, run_dir: Path, stage: str) -> list[float]:
    run = load_run(run_dir)
    records = [r for r in run.phases if r.stage == stage and r.name != "eval"]
    slider = page.locator("#ratio-0")
    seen = []
    for keys in (["Home"], ["ArrowRight", "ArrowRight"], ["End"], ["ArrowLeft"] * 8):
        slider.focus()
        for k in keys:
            page.keyboard.press(k)
        r = float(slider.input_value())
        expected = gap(records, peak_flops=run.peak_flops, peak_bytes_per_s=run.peak_bytes_per_s,
                       ratios=[r]).projections[0]
        got = float(page.locator("#proj-u-0").get_attribute("data-value"))
        assert got == pytest.approx(expected.utilization, rel=1e-12), (r, got, expected)
        assert page.locator("#proj-u-0").inner_text() == f"{100 * expected.utilization:.2f}%"
        busy = page.locator("#proj-busy-0")
        if expected.busy is None:  # a short real run whose phases the 20 Hz sampler never caught: no line
            assert busy.get_attribute("data-value") == "" and busy.inner_text() == "—"
        else:
            assert float(busy.get_attribute("data-value")) == pytest.approx(expected.busy, rel=1e-12)
        assert page.locator("#ratio-out-0").inner_text() == f"{r:g}:1"
        seen.append(r)
    return seen


def test_rl_report_slider_in_browser(browser, tmp_path):
    run_dir = synthetic_run(tmp_path / "rl", steps=30)
    page, errors = _open(browser, write_report(run_dir), tmp_path)
    drawn = dict(_charts_drawn(page))
    assert {"timeline-0", "projection-0", "roofline-fig", "evals-fig"} <= set(drawn)
    assert all(n > 0 for n in drawn.values()), drawn
    # measured ratio ≈ 5.32:1 → the slider starts at 5; Home → 1, +2 → 3, End → 20, −8 → 12
    assert _slider_matches_gap(page, run_dir, "grpo") == [1.0, 3.0, 20.0, 12.0]
    assert page.locator("#proj-busy-0").get_attribute("data-value") != ""  # this run has a busy line to project
    # 1:1 against the nominal step by hand (the jitter of ±10% on seconds moves it a few %):
    # u_gen = (0.6e9/1.2)/80e9 = 0.00625, u_ref = (2.4e9/0.08)/80e9 = 0.375, u_upd = (7.2e9/0.25)/80e9 = 0.36,
    # score 0. Rollout (1.33 s) is scaled to the update's 0.25 s: k = 0.25/1.33 = 0.18797;
    # U = (0.25·0.36 + k·(1.2·0.00625 + 0.05·0 + 0.08·0.375)) / 0.5 = (0.09 + 0.18797·0.0375) / 0.5 = 0.1941
    page.locator("#ratio-0").focus()
    page.keyboard.press("Home")
    u1 = float(page.locator("#proj-u-0").get_attribute("data-value"))
    nominal = (0.25 * 0.36 + 0.25 / 1.33 * (1.2 * 0.00625 + 0.08 * 0.375)) / 0.5
    assert u1 == pytest.approx(nominal, rel=0.1)
    page.locator(".node[data-panel='panel-2']").click()
    page.wait_for_selector("#panel-2 .chart[data-rendered='1'] svg.main-svg", timeout=10_000)
    assert page.locator("#panel-2 .chip").first.inner_text() == "generate + score + reference + update"
    page.screenshot(path=str(tmp_path / "report-rl.png"), full_page=True)
    assert errors == []


def test_dpo_drawn_without_generate_and_rl_section_shows_grpo_only(browser, tmp_path):
    run_dir = synthetic_run(tmp_path / "dpo", dpo=True)
    page, errors = _open(browser, write_report(run_dir), tmp_path)
    dpo = page.locator(".node[data-panel='panel-2']")
    assert dpo.locator(".node-kind").inner_text().lower() == "dpo"   # (drawn in capitals by the CSS)
    chip = dpo.locator(".chip").inner_text()
    assert chip == "reference + update · compute-bound" and "eval" not in chip
    bar = dpo.locator(".sharebar span").evaluate_all("els => els.map(e => e.title.split(' ')[0])")
    assert "generate" not in bar and {"reference", "update"} <= set(bar)   # DPO's strip: no generate segment
    assert page.locator("#rl .rl").count() == 1                             # one RL block …
    assert page.locator("#rl .rl h3").inner_text() == "grpo"                # … for GRPO, not DPO
    page.screenshot(path=str(tmp_path / "report-dpo.png"), full_page=True)
    assert errors == []


def test_real_grpo_run_report_in_browser(browser, tmp_path):
    from posttrain.pipeline.run import STAGES

    assert "grpo" in STAGES
    # GRPO straight from the untrained base: the report needs its phases, not a model that learned.
    recipe = tiny_recipe_dict(threads=1, stages=[
        {"stage": "grpo", "steps": 3, "batch_size": 16, "group_size": 4, "max_new_tokens": 16,
         "rewards": [{"name": "gold"}], "kl_coef": 0.01, "save_every": 3, "log_every": 1,
         "data": [{"world": "arithmetic", "n": 200}], "levels": ["L1"]}])
    run_dir = _run(recipe, tmp_path)
    page, errors = _open(browser, write_report(run_dir), tmp_path)
    drawn = dict(_charts_drawn(page))
    assert "timeline-0" in drawn and all(n > 0 for n in drawn.values()), drawn
    _slider_matches_gap(page, run_dir, "grpo")
    page.screenshot(path=str(tmp_path / "report-grpo.png"), full_page=True)
    assert errors == []
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
