"""Bisect the evals of a run (posttrain/report/eval_bisect.py) and `posttrain bisect RUN_DIR`.

Every expectation is hand-computed in a comment: se_d = sqrt(se1² + se2²), marked when |d| > 2·se_d."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.report import bisect_run, load_run, write_report
from posttrain.report.eval_bisect import move
from posttrain.report.summaries import EvalCell

runner = CliRunner()


def _row(stage: str, eval_: str, level: str | None, value: float, stderr: float | None, *, rnd: int | None = None) -> dict:
    return {"stage": stage, "checkpoint": f"checkpoints/{stage}/final", "eval": eval_, "level": level,
            "metric": "exact_match", "value": value, "n": 100, "stderr": stderr, "round": rnd}


ROWS = [
    # A: 0.50 → 0.70 → 0.55, se 0.05 each. se_d = sqrt(0.0025 + 0.0025) = 0.0707, 2·se_d = 0.1414:
    #    +0.20 > 0.1414 → up at sft; −0.15 < −0.1414 → down at grpo; first drop grpo.
    _row("base", "a", "easy", 0.50, 0.05), _row("sft", "a", "easy", 0.70, 0.05), _row("grpo", "a", "easy", 0.55, 0.05),
    # B: 0.50 → 0.40, se 0.05 each: |−0.10| ≤ 0.1414 → flat; never dropped.
    _row("base", "b", None, 0.50, 0.05), _row("sft", "b", None, 0.40, 0.05),
    # C: 0.90 → 0.10 without standard errors: unknown, not marked, no first drop.
    _row("base", "c", None, 0.90, None), _row("sft", "c", None, 0.10, None),
    # D: base 0.80 (se 0.03), no sft row, grpo 0.50 (se 0.04): compared base → grpo.
    #    se_d = sqrt(0.0009 + 0.0016) = 0.05, 2·se_d = 0.10; −0.30 < −0.10 → down at grpo.
    _row("base", "d", None, 0.80, 0.03), _row("grpo", "d", None, 0.50, 0.04),
]


def _run_dir(tmp_path: Path, rows: list[dict]) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_moves_beyond_two_standard_errors_and_first_drop(tmp_path: Path) -> None:
    tracks = {t.row[0]: t for t in bisect_run(load_run(_run_dir(tmp_path, ROWS)))}
    a = tracks["a"]
    assert list(a.values) == ["base", "sft", "grpo"]
    assert [m.verdict for m in a.moves] == ["up", "down"]
    assert a.moves[0].se == pytest.approx(0.070711, abs=1e-6) and a.moves[1].delta == pytest.approx(-0.15)
    assert a.first_drop == "grpo" and [m.after for m in a.marked] == ["sft", "grpo"]
    assert [m.verdict for m in tracks["b"].moves] == ["flat"] and tracks["b"].first_drop is None
    c = tracks["c"]
    assert [(m.verdict, m.se) for m in c.moves] == [("unknown", None)] and c.first_drop is None and not c.marked
    d = tracks["d"]
    assert list(d.values) == ["base", "grpo"]
    assert [(m.before, m.after, m.verdict) for m in d.moves] == [("base", "grpo", "down")]
    assert d.moves[0].se == pytest.approx(0.05) and d.first_drop == "grpo"


def test_move_edges() -> None:
    # 0.50 → 0.41 with se 0.03 and 0.04: se_d 0.05, |−0.09| ≤ 0.10 → flat; 0.50 → 0.39: −0.11 → down
    assert move(EvalCell(0.50, 0.03, 100), EvalCell(0.41, 0.04, 100)).verdict == "flat"
    assert move(EvalCell(0.50, 0.03, 100), EvalCell(0.39, 0.04, 100)).verdict == "down"
    # a stderr of 0 is known: 0.0 → 0.2 (se 0 and 0.04): 0.2 > 0.08 → up
    assert move(EvalCell(0.0, 0.0, 100), EvalCell(0.2, 0.04, 100)).verdict == "up"
    # NaN stderr (binomial_stderr of n=0) is unknown; a NaN value is no move at all
    assert move(EvalCell(0.5, float("nan"), 0), EvalCell(0.1, 0.04, 100)).verdict == "unknown"
    assert move(EvalCell(float("nan"), 0.03, 100), EvalCell(0.1, 0.04, 100)) is None


def test_rounds_in_pipeline_order(tmp_path: Path) -> None:
    # base 0.6 → r1.dpo 0.8 → r2.dpo 0.5, se 0.04 each: se_d = 0.0566, 2·se_d = 0.113;
    # +0.2 → up at r1.dpo, −0.3 → down at r2.dpo (first drop, a round's checkpoint)
    rows = [_row("base", "a", None, 0.6, 0.04), _row("r1.dpo", "a", None, 0.8, 0.04, rnd=1),
            _row("r2.dpo", "a", None, 0.5, 0.04, rnd=2)]
    (t,) = bisect_run(load_run(_run_dir(tmp_path, rows)))
    assert list(t.values) == ["base", "r1.dpo", "r2.dpo"] and [m.verdict for m in t.moves] == ["up", "down"]
    assert t.first_drop == "r2.dpo"


def test_report_marks_with_the_same_rule(tmp_path: Path) -> None:
    html = write_report(_run_dir(tmp_path, ROWS)).read_text()
    section = html[html.index('id="evals"'):]
    section = section[:section.index("</table>")]
    # A: +20.0 up, −15.0 down; B: −10.0 flat; C: −80.0 without stderr — flat, not coloured down
    assert '<span class="delta up">+20.0</span>' in section and '<span class="delta down">-15.0</span>' in section
    assert '<span class="delta flat">-10.0</span>' in section and '<span class="delta flat">-80.0</span>' in section
    assert "<th>first drop</th>" in section and section.count('<span class="delta down">grpo</span>') == 2  # A and D


def test_cli_bisect_table(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bisect", str(_run_dir(tmp_path, ROWS))], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    lines = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
             for line in result.output.splitlines() if line.startswith("│") and "·" in line}
    # columns: base, sft, grpo, first drop
    assert lines["a easy · exact_match"] == ["50.0%", "70.0% (+20.0) ▲", "55.0% (-15.0) ▼", "grpo"]
    assert lines["b · exact_match"] == ["50.0%", "40.0% (-10.0)", "", "—"]
    assert lines["c · exact_match"] == ["90.0%", "10.0% (-80.0)", "", "—"]
    assert lines["d · exact_match"] == ["80.0%", "", "50.0% (-30.0) ▼", "grpo"]


@pytest.mark.parametrize("make, needle", [
    (lambda p: p / "nope", "does not exist"),
    (lambda p: p, "has no evals.jsonl"),
    (lambda p: _run_dir(p, [{"stage": "sft"}]), "missing 'eval'"),  # a row without eval/metric/value
])
def test_cli_bisect_bad_folder(tmp_path: Path, make, needle: str) -> None:
    result = runner.invoke(app, ["bisect", str(make(tmp_path))], env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error:") and needle in text, text


# ---- the marks the pipeline writes into evals.jsonl (posttrain/pipeline/evals.py) -------------------
def _append_stagewise(path: Path, rows: list[dict]) -> None:
    """Append ROWS to evals.jsonl one checkpoint at a time, as the pipeline does (stages in order)."""
    from posttrain.pipeline.evals import append_evals, record_from_json

    for stage in dict.fromkeys(r["stage"] for r in rows):
        append_evals(path, [record_from_json(r) for r in rows if r["stage"] == stage])


def test_evals_jsonl_carries_the_bisect_marks(tmp_path: Path) -> None:
    path = tmp_path / "evals.jsonl"
    _append_stagewise(path, ROWS)
    written = [json.loads(x) for x in path.read_text().splitlines()]
    marks = {(r["eval"], r["stage"]): (r.get("vs"), r.get("moved")) for r in written}
    # the same verdicts as the bisect table above: A up at sft, down at grpo; B flat ("none"); C unknown;
    # D compared base → grpo (no sft row), down; every first row of a kind unmarked
    assert marks == {("a", "base"): (None, None), ("a", "sft"): ("base", "up"), ("a", "grpo"): ("sft", "down"),
                     ("b", "base"): (None, None), ("b", "sft"): ("base", "none"),
                     ("c", "base"): (None, None), ("c", "sft"): ("base", "unknown"),
                     ("d", "base"): (None, None), ("d", "grpo"): ("base", "down")}
    a_sft = next(r for r in written if (r["eval"], r["stage"]) == ("a", "sft"))
    # d = 0.70 − 0.50 = 0.20; threshold = 2 · sqrt(0.05² + 0.05²) = 0.141421
    assert a_sft["delta"] == pytest.approx(0.20) and a_sft["threshold"] == pytest.approx(0.141421, abs=1e-6)
    c_sft = next(r for r in written if (r["eval"], r["stage"]) == ("c", "sft"))
    assert c_sft["threshold"] is None and c_sft["delta"] == pytest.approx(-0.80)  # no stderr: shown, not judged
    # one rule: every mark is the verdict report.eval_bisect gives the same move
    tracks = {t.row[0]: t for t in bisect_run(load_run(path.parent))}
    for r in written:
        if "moved" in r:
            m = next(m for m in tracks[r["eval"]].moves if m.after == r["stage"])
            assert r["moved"] == {"flat": "none"}.get(m.verdict, m.verdict) and r["vs"] == m.before


def test_a_re_evaluated_checkpoint_is_not_a_move_and_old_rows_still_read(tmp_path: Path) -> None:
    from posttrain.pipeline.evals import append_evals, record_from_json
    from posttrain.pipeline.run import read_evals

    path = tmp_path / "evals.jsonl"
    old = [_row("base", "a", None, 0.5, 0.05), _row("sft", "a", None, 0.9, 0.03)]  # written before the marks existed
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    # sft evaluated again (a resumed run): compared with base (0.9 − 0.5 = 0.4 > 2·0.0583 → up), not with itself
    again = append_evals(path, [record_from_json(_row("sft", "a", None, 0.9, 0.03))])
    assert (again[0]["vs"], again[0]["moved"]) == ("base", "up")
    records = read_evals(path)  # old unmarked rows and new marked ones alike
    assert [(r.stage, r.value) for r in records] == [("base", 0.5), ("sft", 0.9), ("sft", 0.9)]
    assert not hasattr(records[-1], "moved")
