"""posttrain.report without a browser: reading the run folder, the stage character, downsampling, the
RL iteration, the page's sections and its size and speed on a 1,000-step run.

`synthetic_run` writes a run folder in the documented formats (docs/run_dir.md): pretrain and SFT
stages that log `update` (and a final `eval`) and an RL stage that logs `generate`, `score`,
`reference`, `update` per step, with costs sized like a tiny model on a CPU. The browser test
(test_report_browser.py) uses it too.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import pytest
import yaml

from posttrain.report import ReportError, character, downsample, load_run, rl_iteration, summarize, write_report
from posttrain.report.summaries import PhaseRow, eval_table, rl_iterations
from posttrain.telemetry.gap import gap

# CPU roofs of the synthetic device: 80 GFLOP/s fp32, 10 GB/s → ridge point 8 FLOP/B.
PEAK_FLOPS, PEAK_BW = 80e9, 10e9
# (name, seconds, flops, bytes, busy) of one RL step: generate is overhead-bound (0.5 GFLOP/s at 0.6
# FLOP/B: attainable 6 GFLOP/s, efficiency 0.083), update compute-bound (28.8 GFLOP/s at 36 FLOP/B:
# efficiency 0.36), score declares no cost.
RL_STEP = (("generate", 1.2, 0.6e9, 1.0e9, 0.92), ("score", 0.05, 0.0, 0.0, 0.90),
           ("reference", 0.08, 2.4e9, 0.12e9, 0.95), ("update", 0.25, 7.2e9, 0.2e9, 0.97))


# One DPO step: a reference forward and an update, both compute-bound (40 and 30 GFLOP/s at 20 and 30
# FLOP/B), and no generation; its stage ends with a 5 s eval — most of its phase time (5 / (12·0.4 + 5) = 51%).
DPO_STEP = (("reference", 0.1, 4e9, 0.2e9, 0.95), ("update", 0.3, 9e9, 0.3e9, 0.96))


def synthetic_run(root: Path, *, steps: int = 12, rl: bool = True, seed: int = 0, nan_at: int | None = None,
                  dpo: bool = False) -> Path:
    """Write a run folder with pretrain, SFT, (if `dpo`) DPO and (if `rl`) GRPO stages of `steps` steps each."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    kinds = ["pretrain", "sft"] + (["dpo"] if dpo else []) + (["grpo"] if rl else [])
    (root / "recipe.yaml").write_text(yaml.safe_dump({
        "name": "synthetic", "model": {"init": "tiny-1m"},
        "stages": [{"stage": k, "name": None, "steps": steps} for k in kinds]}, sort_keys=False))
    (root / "device.json").write_text(json.dumps({
        "name": "Synthetic CPU", "kind": "cpu", "peaks": {"flops": {"fp32": PEAK_FLOPS, "bf16": 4 * PEAK_FLOPS},
                                                           "bytes_per_s": PEAK_BW},
        "source": "synthetic (test)", "dtype": "fp32"}))
    t = 0.0
    phases, metrics, evals = [], [], []

    def phase(stage: str, step: int, name: str, seconds: float, flops: float, nbytes: float, busy: float | None) -> None:
        nonlocal t
        phases.append({"stage": stage, "step": step, "name": name, "start": t, "seconds": seconds, "flops": flops,
                       "bytes": nbytes, "busy": busy, "parent": None})
        t += seconds

    def eval_rows(stage: str, acc: float) -> None:
        for level in ("L1", "L2"):
            for metric, v in (("format", min(1.0, acc + 0.3)), ("exact_match", acc)):
                evals.append({"stage": stage, "checkpoint": f"checkpoints/{stage}/final", "eval": "arithmetic",
                              "level": level, "metric": metric, "value": v, "n": 64,
                              "stderr": math.sqrt(v * (1 - v) / 64)})

    eval_rows("base", 0.0)
    for k, kind in enumerate(kinds):
        for step in range(1, steps + 1):
            if kind in ("grpo", "dpo"):
                for name, sec, f, y, b in RL_STEP if kind == "grpo" else DPO_STEP:
                    phase(kind, step, name, sec * rng.uniform(0.9, 1.1), f, y, b)
            else:
                phase(kind, step, "update", 0.4 * rng.uniform(0.9, 1.1), 20e9, 0.5e9, 0.95)  # 50 GFLOP/s: compute
            loss = 4.0 * math.exp(-step / steps) + rng.uniform(0, 0.05)
            m = {"stage": kind, "step": step, "time": t, f"loss/{'policy' if kind == 'grpo' else 'lm'}": loss,
                 "train/lr": 1e-3, "train/grad_norm": rng.uniform(0.5, 2.0)}
            if step == nan_at and kind == "sft":
                m["loss/lm"] = float("nan")
            if kind == "grpo":
                m.update({"reward/gold": 0.2 + 0.5 * step / steps, "kl": 0.001 * step, "entropy": 1.5 - step / steps})
            metrics.append(m)
        phase(kind, steps, "eval", 5.0 if kind == "dpo" else 1.0, 0.0, 0.0, 0.5)
        eval_rows(kind, [0.1, 0.4, 0.55, 0.7][k] if dpo else [0.1, 0.4, 0.7][k])
    for name, rows in (("phases.jsonl", phases), ("metrics.jsonl", metrics), ("evals.jsonl", evals)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _row(name: str, seconds: float, bound: str) -> PhaseRow:
    return PhaseRow(name=name, occurrences=1, seconds=seconds, share=0.0, flops=0.0, bytes=0.0, flops_per_s=None,
                    bytes_per_s=None, intensity=None, pct_compute_roof=None, pct_bandwidth_roof=None,
                    efficiency=None, bound=bound, busy=None)


def test_character_rules():
    # generate + update → an RL stage; the detail names the two longest phases: generate 3 of 4 s = 75%,
    # update 1 of 4 s = 25% (eval is measurement: left out of the tag and the shares, however long).
    c = character([_row("generate", 3.0, "overhead"), _row("update", 1.0, "compute"), _row("eval", 9.0, "unknown")])
    assert c.tag == "generate + update" and c.kind == "rl"
    assert c.detail == ("generate overhead-bound (75% of the training time) · "
                        "update compute-bound (25% of the training time)")
    # GRPO/PPO: every phase it ran, in loop order, whatever order they were timed in
    c = character([_row("update", 1.0, "compute"), _row("sync", 0.1, "memory"), _row("reference", 0.5, "compute"),
                   _row("score", 0.2, "unknown"), _row("generate", 3.0, "overhead")])
    assert (c.tag, c.kind) == ("generate + score + reference + update + sync", "rl")
    # DPO: reference + update, no generate → not RL; the verdict of the longest phase (update 3 s)
    c = character([_row("reference", 1.0, "compute"), _row("update", 3.0, "compute"), _row("eval", 30.0, "unknown")])
    assert (c.tag, c.kind) == ("reference + update · compute-bound", "compute")
    # no generate: the verdict of the longest phase with a verdict (sync 2 s memory beats update 1 s)
    c = character([_row("update", 1.0, "compute"), _row("sync", 2.0, "memory"), _row("eval", 5.0, "unknown")])
    assert (c.tag, c.kind) == ("update + sync · memory-bound", "memory")
    # nothing with a verdict (no cost declared / no peak); only eval → nothing trained
    assert character([_row("update", 1.0, "unknown")]).tag == "update · unmeasured"
    assert character([_row("eval", 1.0, "overhead")]).tag == "unmeasured"


def test_downsample_keeps_extremes_and_bounds_points():
    steps = list(range(1, 1001))
    values = [1.0] * 1000
    values[500] = 50.0   # a spike at step 501
    values[700] = -3.0   # a dip at step 701
    s, v = downsample(steps, values, max_points=100)
    assert len(s) <= 100                          # 2 + 49 buckets × 2 = 100 at most
    assert s[0] == 1 and s[-1] == 1000            # first and last kept
    assert 501 in s and v[s.index(501)] == 50.0   # the spike survives
    assert 701 in s and v[s.index(701)] == -3.0
    assert s == sorted(s)
    assert downsample([1, 2, 3], [3.0, 2.0, 1.0], max_points=100) == ([1, 2, 3], [3.0, 2.0, 1.0])  # short: as is
    with pytest.raises(ValueError, match="max_points"):
        downsample(steps, values, max_points=3)


def test_summaries_of_synthetic_run(tmp_path):
    run = load_run(synthetic_run(tmp_path / "r"))
    by = {s.info.name: s for s in summarize(run)}
    assert list(by) == ["pretrain", "sft", "grpo"]
    # pretrain update: 20e9 FLOP / 0.4 s = 50 GFLOP/s at 40 FLOP/B ≥ ridge 8 → efficiency 50/80 = 0.625 → compute
    assert by["pretrain"].character.tag == "update · compute-bound"
    assert by["grpo"].character.tag == "generate + score + reference + update"
    # the one 1 s eval after 12 updates of ≈0.4 s: 1 / (≈4.8 + 1) ≈ 17% of the stage's phase time, apart
    assert 0.15 < by["pretrain"].eval_share < 0.19
    upd = next(r for r in by["pretrain"].phases if r.name == "update")
    assert upd.intensity == pytest.approx(40.0)   # 20e9 / 0.5e9
    assert upd.occurrences == 12
    table = eval_table(run)
    assert table.columns == ["base", "pretrain", "sft", "grpo"]   # base first, then pipeline order
    assert len(table.rows) == 4                                   # 2 levels × 2 metrics


def test_rl_iteration_projection_equals_gap(tmp_path):
    run = load_run(synthetic_run(tmp_path / "r"))
    it = rl_iteration(run, "grpo")
    assert it is not None and it.pooled_steps == 12
    assert [s.name for s in it.segments] == ["generate", "score", "reference", "update"]
    assert it.segments[-1].x1 == pytest.approx(it.cycle.seconds)   # laid end to end: axis = Σ exclusive time
    work = [r for r in run.phases if r.stage == "grpo" and r.name != "eval"]
    g = gap(work, peak_flops=PEAK_FLOPS, peak_bytes_per_s=PEAK_BW)
    assert it.pooled.projections == g.projections
    # With the nominal step (no jitter): R0 = 1.2 + 0.05 + 0.08 = 1.33 s, U0 = 0.25 s → measured 5.32:1,
    # and the pooled ratio of the jittered steps sits within ±10% of it.
    assert 5.32 * 0.9 < it.pooled.rollout_update_ratio < 5.32 * 1.1
    assert rl_iteration(run, "sft") is None   # no rollout phase


def test_dpo_is_reference_plus_update_not_rl_and_not_eval(tmp_path):
    import io

    from rich.console import Console

    from posttrain.report import summary_renderable

    run = load_run(synthetic_run(tmp_path / "r", dpo=True))
    by = {s.info.name: s for s in summarize(run)}
    dpo = by["dpo"]
    # eval is 5 s of ≈ 9.8 s (51%): the longest phase, yet the character is the training it did
    assert dpo.eval_share > 0.45 and max(dpo.phases, key=lambda r: r.seconds).name == "eval"
    assert (dpo.character.tag, dpo.character.kind) == ("reference + update · compute-bound", "compute")
    assert "generate" not in dpo.character.tag
    assert rl_iteration(run, "dpo") is None and dpo.gap.projections == []   # no rollout:update ratio
    assert [it.stage for it in rl_iterations(run)] == ["grpo"]
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(summary_renderable(run.run_dir))
    text = console.export_text()
    assert "grpo cycle" in text and "dpo cycle" not in text
    assert "reference + update · compute-bound (+ eval 5" in text   # eval's share shown apart


def test_report_sections_rl_and_plain(tmp_path):
    page = write_report(synthetic_run(tmp_path / "rl")).read_text()
    for needle in ('id="pipeline"', 'id="rl"', 'id="roofline"', 'id="evals"', 'id="doctor"', 'data-fig="timeline-0"',
                   'id="ratio-0"', "generate + score + reference + update", 'id="memory"'):
        assert needle in page, needle
    plain = write_report(synthetic_run(tmp_path / "plain", rl=False)).read_text()
    assert "timeline-0" not in plain and "ratio-0" not in plain
    assert '<section id="rl" class="none">' in plain and "This run has no RL stage" in plain  # said, not drawn
    assert 'id="roofline"' in plain
    assert "<script src" not in plain and "<link" not in plain   # self-contained: nothing fetched


def test_report_notes_nan_and_downsampling(tmp_path):
    run_dir = synthetic_run(tmp_path / "r", steps=900, rl=False, nan_at=450)
    page = write_report(run_dir).read_text()
    assert "loss/lm was non-finite at step(s) 450" in page
    assert "Curves downsampled to ≤400 points per series from up to 900 logged steps" in page


def test_doctor_slot(tmp_path):
    run_dir = synthetic_run(tmp_path / "r", rl=False)
    assert "has no doctor.json" in write_report(run_dir).read_text()
    (run_dir / "doctor.json").write_text(json.dumps({"findings": [
        {"title": "SFT overfitting", "severity": "warning", "stage": "sft", "evidence": "eval/loss rose 3 logs in a row"}]}))
    page = write_report(run_dir).read_text()
    assert "SFT overfitting" in page and "eval/loss rose 3 logs in a row" in page


def test_thousand_step_report_is_fast_and_small(tmp_path):
    run_dir = synthetic_run(tmp_path / "big", steps=1000)   # 3 stages × 1,000 steps, 6,003 phase records
    t0 = time.perf_counter()
    out = write_report(run_dir)
    seconds = time.perf_counter() - t0
    size = out.stat().st_size
    assert seconds < 5.0, f"{seconds:.2f} s"
    assert size < 10 * 2**20, f"{size / 2**20:.1f} MiB"


def test_bad_run_dirs(tmp_path):
    with pytest.raises(ReportError, match="does not exist"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="nothing to report"):
        load_run(tmp_path / "empty")
    run_dir = synthetic_run(tmp_path / "broken", rl=False)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[3] = lines[3][:20]   # a cut line in the middle is an error naming file and line…
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"metrics.jsonl:4: not valid JSON"):
        load_run(run_dir)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[4:] + ['{"stage": "sf']) + "\n")  # …a cut last line is not
    assert load_run(run_dir).metrics[-1]["stage"] == "sft"


def test_terminal_summary(tmp_path):
    import io

    from rich.console import Console

    from posttrain.report import summary_renderable

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(summary_renderable(synthetic_run(tmp_path / "r")))
    text = console.export_text()
    assert "generate + score + reference + update" in text and "update · compute-bound" in text
    assert "grpo cycle: rollout:update" in text and "measured over 12 steps" in text
    # evals table: base 0.0% → grpo 70.0% exact match on L1 (synthetic accuracies 0, 0.1, 0.4, 0.7)
    assert "0.0%" in text and "70.0%" in text
    # at 80 columns: each stage stacked, nothing cut, nothing past the edge
    narrow = Console(width=80, record=True, file=io.StringIO())
    narrow.print(summary_renderable(tmp_path / "r"))
    text = narrow.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    assert "grpo (grpo) · 12 steps" in text and "generate + score + reference + update" in text
