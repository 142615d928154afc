"""The gap: time shares, time-weighted utilization vs busy, projection to other rollout:update ratios."""

from __future__ import annotations

import pytest

from posttrain.telemetry.gap import gap, gaps_by_cycle, gaps_by_stage
from posttrain.telemetry.phases import PhaseRecord

P, B = 100e9, 10e9  # ridge 10 FLOP/B


def rec(name: str, seconds: float, flops: float, nbytes: float, busy: float | None, step: int = 1,
        stage: str = "grpo") -> PhaseRecord:
    return PhaseRecord(stage, step, name, 0.0, seconds, flops, nbytes, busy, None)


# One RL cycle: generate 3 s at 1 GFLOP/s (1% of P), busy 0.95; update 1 s at 60 GFLOP/s (60%), busy 1.0.
CYCLE = [rec("generate", 3.0, 3e9, 3e9, 0.95), rec("update", 1.0, 60e9, 0.6e9, 1.0)]


def test_shares_utilization_and_busy():
    g = gap(CYCLE, peak_flops=P, peak_bytes_per_s=B)
    shares = {s.name: s.share for s in g.phases}
    assert shares == {"generate": pytest.approx(0.75), "update": pytest.approx(0.25)}  # 3/4, 1/4
    # U = ΣF / (T·P) = 63e9 / (4 · 100e9) = 0.1575
    assert g.utilization == pytest.approx(0.1575)
    # busy = (3·0.95 + 1·1.0) / 4 = 0.9625 — the dashboard's ~96% against 16% of the roof
    assert g.busy == pytest.approx(0.9625)
    # generate: I = 1 → attainable 10 GFLOP/s, achieved 1 → e = 0.1; update: I = 100 → e = 0.6
    # E = 0.75·0.1 + 0.25·0.6 = 0.225
    assert g.efficiency == pytest.approx(0.225)
    assert g.rollout_update_ratio == pytest.approx(3.0)
    assert {s.name: s.bound for s in g.phases} == {"generate": "overhead", "update": "compute"}


def test_projection_formula():
    g = gap(CYCLE, peak_flops=P, peak_bytes_per_s=B, ratios=(1, 3, 20))
    by_ratio = {p.ratio: p for p in g.projections}
    # r = 1: generate scaled to 1 s → U = (1·0.01 + 1·0.6) / 2 = 0.305; busy = (0.95 + 1.0)/2 = 0.975
    assert by_ratio[1.0].utilization == pytest.approx(0.305)
    assert by_ratio[1.0].busy == pytest.approx(0.975)
    # r = 3 is the measured ratio: the projection reproduces the measurement
    assert by_ratio[3.0].utilization == pytest.approx(g.utilization)
    # r = 20: (20·0.01 + 0.6) / 21 = 0.8/21 = 0.038095
    assert by_ratio[20.0].utilization == pytest.approx(0.8 / 21)


def test_other_phases_keep_their_seconds_in_projection():
    # add a 1 s sync at 0 FLOPs: r = 1 → t = gen 1, update 1, sync 1 → U = (0.01 + 0.6 + 0) / 3 = 0.20333
    cycle = CYCLE + [rec("sync", 1.0, 0.0, 5e9, None)]
    g = gap(cycle, peak_flops=P, peak_bytes_per_s=B, ratios=(1,))
    assert g.projections[0].utilization == pytest.approx(0.61 / 3)


def test_no_projection_without_rollout_or_update_and_no_utilization_without_peak():
    sft = gap([rec("update", 1.0, 60e9, 0.6e9, 1.0, stage="sft")], peak_flops=P, peak_bytes_per_s=B)
    assert sft.projections == [] and sft.rollout_update_ratio is None
    unknown = gap(CYCLE, peak_flops=None, peak_bytes_per_s=None)
    assert unknown.utilization is None and all(p.utilization is None for p in unknown.projections)
    assert unknown.busy == pytest.approx(0.9625)  # busy needs no peak


def test_grouping_by_stage_and_cycle():
    records = CYCLE + [rec("generate", 1.0, 1e9, 1e9, 0.9, step=2), rec("update", 2.0, 120e9, 1.2e9, 1.0, step=2),
                       rec("update", 1.0, 50e9, 1e9, 1.0, stage="sft")]
    stages = gaps_by_stage(records, peak_flops=P, peak_bytes_per_s=B)
    assert list(stages) == ["grpo", "sft"]
    # grpo pooled: T = 3+1+1+2 = 7, F = 3+60+1+120 = 184 GFLOP → U = 184/(7·100) = 0.262857
    assert stages["grpo"].cycles == 2 and stages["grpo"].utilization == pytest.approx(184 / 700)
    cycles = gaps_by_cycle(records, peak_flops=P, peak_bytes_per_s=B)
    # cycle 2: T = 3, F = 121 GFLOP → 121/300
    assert cycles[("grpo", 2)].utilization == pytest.approx(121 / 300)
