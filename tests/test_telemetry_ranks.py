"""Every data-parallel rank's phases in phases.jsonl (posttrain/telemetry/ranks.py): the gather of two
spawned gloo processes by hand, and a 2-rank SFT run whose phases.jsonl holds rank 1's update phases
(rank 1 still writes nothing into the run folder: tests/ddp_worker.py forbids it)."""

from __future__ import annotations

import json
import time

import pytest
import torch.multiprocessing as mp

from ddp_phases import gather
from posttrain.telemetry.phases import read_phases
from posttrain.telemetry.ranks import rank_worker
from test_distributed import _free_port, _write, run_ranks, sft_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rank_worker_names():
    assert rank_worker(0) == "main" and rank_worker(1) == "rank1" and rank_worker(12) == "rank12"


def test_gather_of_two_gloo_processes(tmp_path):
    base = time.perf_counter()  # both children read the same monotonic clock (one machine)
    ctx = mp.start_processes(gather, args=(_free_port(), base, str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1):  # raises (and ends the other process) when one fails
            assert time.monotonic() < deadline, "the 2-process gather test hung"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    recs = read_phases(tmp_path / "phases.jsonl")
    assert [(r.worker, r.name) for r in recs] == [("main", "update"), ("rank1", "update"), ("rank1", "sync")]
    moved = recs[1]
    # rank 1's start 12.0 s on its clock, its run started 10 s before rank 0's → 2.0 s on rank 0's (the two
    # wall-clock readings of the shift are µs apart; 1 ms allows a busy machine's scheduling between them)
    assert moved.start == pytest.approx(2.0, abs=1e-3) and moved.seconds == 0.5 and moved.flops == 1e9
    raw = [json.loads(line) for line in (tmp_path / "phases.jsonl").read_text().splitlines()]
    assert "worker" not in raw[0] and raw[1]["worker"] == "rank1"  # rank 0's lines read as they always did


@pytest.mark.slow
def test_two_rank_sft_phases_hold_rank1_updates(tmp_path):
    d = sft_recipe()
    d["stages"][0].update(steps=3, save_every=3)
    out = tmp_path / "two"
    run_ranks(2, _write(tmp_path, d), out)  # ranks ≥ 1 cannot write under `out` (tests/ddp_worker.py)
    recs = [r for r in read_phases(out / "phases.jsonl") if r.stage == "sft"]
    updates = {w: sorted(r.step for r in recs if r.worker == w and r.name == "update") for w in ("main", "rank1")}
    assert updates == {"main": [1, 2, 3], "rank1": [1, 2, 3]}
    assert {r.worker for r in recs} == {"main", "rank1"}
    for step in (1, 2, 3):
        # both ranks' updates hold the step's gradient all-reduce, so on one clock their intervals meet
        a, b = (next(r for r in recs if r.worker == w and r.name == "update" and r.step == step) for w in ("main", "rank1"))
        assert a.start < b.start + b.seconds and b.start < a.start + a.seconds, (a, b)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # each logged step folds rank 0's update under phase/…, rank 1's under phase@rank1/… (never summed)
    for m in metrics:
        own, other = (sum(r.seconds for r in recs if r.worker == w and r.name == "update" and r.step == m["step"])
                      for w in ("main", "rank1"))
        assert m["phase/update/seconds"] == pytest.approx(own)
        assert m["phase@rank1/update/seconds"] == pytest.approx(other) and other > 0
