"""One timeline per worker (posttrain/telemetry/lanes.py) and where it shows: the report's RL section and
`posttrain phases`. Synthetic phases.jsonl of a synchronous and an asynchronous (staleness 1) split run,
and of an old one-worker run; every expected busy fraction is computed by hand in the comment beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from posttrain.report.charts import workers_figure
from posttrain.report.page import render
from posttrain.report.run_data import load_run
from posttrain.report.summaries import rl_iteration
from posttrain.telemetry.cli import phases_command
from posttrain.telemetry.lanes import IDLE, lanes, stage_lanes, step_lanes, step_window
from posttrain.telemetry.phases import PhaseRecord, read_phases


def rec(name: str, step: int, start: float, seconds: float, worker: str = "main", parent: str | None = None,
        stage: str = "grpo") -> PhaseRecord:
    return PhaseRecord(stage=stage, step=step, name=name, start=start, seconds=seconds, flops=0.0, bytes=0.0,
                       busy=None, parent=parent, worker=worker)


def sync_run(steps: int = 3) -> list[PhaseRecord]:
    """Synchronous split RL, a 6 s cycle: rollout0 generates [b, b+3); then the learner updates [b+3, b+5)
    — 1.5 s of its own plus a nested 0.5 s `sync` from b+4.5 — and idles [b+5, b+6) (b = 6(s−1))."""
    out = []
    for s in range(1, steps + 1):
        b = 6.0 * (s - 1)
        out += [rec("generate", s, b, 3.0, "rollout0"), rec("sync", s, b + 4.5, 0.5, parent="update"),
                rec("update", s, b + 3.0, 1.5)]  # a parent is written after its child, as Telemetry writes it
    return out


def async_run(steps: int = 4) -> list[PhaseRecord]:
    """Asynchronous, staleness 1: rollout0 generates step s over [3(s−1), 3s) back to back; the learner
    updates step s over [3s, 3s+2.5) — while step s+1 is being generated."""
    out = []
    for s in range(1, steps + 1):
        out += [rec("generate", s, 3.0 * (s - 1), 3.0, "rollout0"), rec("update", s, 3.0 * s, 2.5)]
    return out


def test_sync_lanes_idle_in_turn():
    recs = sync_run()
    assert step_window(recs, 1) == (0.0, 6.0)  # step 1's first start → step 2's first start
    ln = step_lanes(recs, 1)
    assert [lane.worker for lane in ln.lanes] == ["main", "rollout0"]
    main, roll = ln.lane("main"), ln.lane("rollout0")
    # learner: update inclusive = 1.5 + 0.5 (nested sync) = 2 s of 6 → 1/3; rollout0: 3 s of 6 → 0.5
    assert main.busy == pytest.approx(2.0) and main.fraction == pytest.approx(1 / 3)
    assert roll.busy == pytest.approx(3.0) and roll.fraction == pytest.approx(0.5)
    assert [(s.name, s.x0, s.x1) for s in main.spans] == [(IDLE, 0.0, 3.0), ("update", 3.0, 5.0), (IDLE, 5.0, 6.0)]
    assert [(s.name, s.x0, s.x1) for s in roll.spans] == [("generate", 0.0, 3.0), (IDLE, 3.0, 6.0)]
    # in sync the two never overlap: 1/3 + 1/2 = 5/6 ≤ 1
    assert main.fraction + roll.fraction == pytest.approx(5 / 6)
    # the last step has no successor: its window ends at its last end, 12 + 5 = 17 → [12, 17): 2/5 and 3/5
    last = step_lanes(recs, 3)
    assert (last.start, last.end) == (12.0, 17.0)
    assert last.lane("main").fraction == pytest.approx(0.4) and last.lane("rollout0").fraction == pytest.approx(0.6)
    # the stage average over [0, 17): learner 3 × 2 = 6 s → 6/17; rollout0 9 s → 9/17
    whole = stage_lanes(recs)
    assert whole.lane("main").fraction == pytest.approx(6 / 17)
    assert whole.lane("rollout0").fraction == pytest.approx(9 / 17)


def test_async_lanes_overlap():
    recs = async_run()
    # step 2's window: generate 2 starts at 3, generate 3 at 6 → [3, 6), the steady-state cycle of 3 s
    ln = step_lanes(recs, 2)
    assert (ln.start, ln.end) == (3.0, 6.0)
    roll, main = ln.lane("rollout0"), ln.lane("main")
    assert roll.fraction == pytest.approx(1.0)  # generate 2 fills [3, 6)
    # the learner's update of step 1 ([3, 5.5)) lies in step 2's window: 2.5 / 3 — clipped by time, not tag
    assert main.fraction == pytest.approx(2.5 / 3)
    assert [s.step for s in main.spans if s.name == "update"] == [1]
    assert roll.fraction + main.fraction == pytest.approx(1 + 2.5 / 3)  # > 1: the two overlap
    # step 1 is the warm-up: [0, 3), the learner waits for the first rollout → 0 busy
    assert step_lanes(recs, 1).lane("main").fraction == 0.0
    assert [s.name for s in step_lanes(recs, 1).lane("main").spans] == [IDLE]


def test_lanes_clip_and_merge():
    recs = [rec("update", 1, 1.0, 2.0), rec("score", 1, 2.0, 2.0)]  # overlapping spans of one worker (3 → 4)
    ln = lanes(recs, 2.0, 5.0)
    # [1, 3) clipped to [2, 3); [2, 4) starts under it → drawn [3, 4); busy 2 of 3, not 3
    assert [(s.name, s.x0, s.x1) for s in ln.lane("main").spans] == [("update", 2.0, 3.0), ("score", 3.0, 4.0),
                                                                     (IDLE, 4.0, 5.0)]
    assert ln.lane("main").fraction == pytest.approx(2 / 3)
    assert lanes(recs, 0.0, 1.0, workers=["rollout0"]).lane("rollout0").spans[0].name == IDLE
    with pytest.raises(ValueError, match="ends before it starts"):
        lanes(recs, 2.0, 1.0)
    with pytest.raises(ValueError, match="no phase record for step 9"):
        step_window(recs, 9)


# ---- the report and the CLI, from a run folder -----------------------------------------------------------

def write_run(path: Path, records: list[PhaseRecord], *, raw: list[dict] | None = None) -> Path:
    path.mkdir()
    (path / "recipe.yaml").write_text("name: lanes\nstages:\n- stage: grpo\n  steps: 4\n")
    lines = raw if raw is not None else [r.to_json() for r in records]
    (path / "phases.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    steps = sorted({x["step"] for x in lines})
    (path / "metrics.jsonl").write_text("".join(json.dumps({"stage": "grpo", "step": s, "loss": 1.0}) + "\n" for s in steps))
    return path


def test_report_draws_a_lane_per_worker(tmp_path):
    run = load_run(write_run(tmp_path / "async", async_run()))
    it = rl_iteration(run, "grpo")
    # cycles by phase time: every step 5.5 s → the median-low is step 1 (ties keep step order)
    assert it is not None and it.lanes is not None and it.step == 1
    assert [lane.worker for lane in it.lanes.lanes] == ["main", "rollout0"]
    html = render(run)
    assert 'data-fig="workers-0"' in html
    fig = workers_figure(it.lanes, it.step)
    rows = {y for trace in fig["data"] for y in trace["y"]}
    assert rows == {"rollout0 · 100% busy", "main · 0% busy"}  # step 1: the warm-up window [0, 3)
    idle = next(t for t in fig["data"] if t["name"] == IDLE)
    assert idle["base"] == [0.0] and idle["x"] == [3.0]  # the learner's lane: idle throughout
    # the stage average over [0, 14.5): rollout0 12 s → 83%, learner 4 × 2.5 = 10 s → 69%
    assert "<b>rollout0</b> 100% (stage average 83%)" in html and "<b>main</b> 0% (stage average 69%)" in html


def test_an_old_one_worker_run_gets_one_lane(tmp_path):
    # written before records had `worker`: no such key → "main". generate [0, 2), score [2, 2.5), update
    # [3, 4) (a 0.5 s host gap), step 2 from 4.5 → window [0, 4.5): busy 3.5 / 4.5 = 77.8%
    raw = []
    for s, b in ((1, 0.0), (2, 4.5)):
        for name, t, secs in (("generate", 0.0, 2.0), ("score", 2.0, 0.5), ("update", 3.0, 1.0)):
            raw.append({"stage": "grpo", "step": s, "name": name, "start": b + t, "seconds": secs, "flops": 0.0,
                        "bytes": 0.0, "busy": None, "parent": None})
    path = write_run(tmp_path / "old", [], raw=raw)
    assert all(r.worker == "main" for r in read_phases(path / "phases.jsonl"))
    it = rl_iteration(load_run(path), "grpo")
    assert [lane.worker for lane in it.lanes.lanes] == ["main"]
    assert it.lanes.lane("main").fraction == pytest.approx(3.5 / 4.5)
    assert "<b>main</b> 78% (stage average" in render(load_run(path))
    fig = workers_figure(it.lanes, it.step)
    # one bar trace per phase name plus idle ([2.5, 3) and [4, 4.5)), all on the one row
    assert [(t["name"], t["y"]) for t in fig["data"]] == [("generate", ["main · 78% busy"]), ("score", ["main · 78% busy"]),
                                                        ("update", ["main · 78% busy"]), (IDLE, ["main · 78% busy"] * 2)]


def test_phases_cli_prints_the_split_by_worker(tmp_path):
    path = write_run(tmp_path / "sync", sync_run())
    console = Console(record=True, width=160)
    phases_command(path, console=console)
    out = console.export_text()
    assert "stage grpo by worker, over its 17.00 s span" in out
    # learner: update 3 × 2 = 6 s (the nested sync inside it), busy 6/17 = 35%, idle 11 s; rollout0 9 s, 53%
    main = next(line for line in out.splitlines() if line.strip().startswith("│ main") or line.strip().startswith("main"))
    roll = next(line for line in out.splitlines() if "rollout0" in line)
    assert "6.000" in main and "11.000" in main and "35%" in main
    assert "9.000" in roll and "8.000" in roll and "53%" in roll
