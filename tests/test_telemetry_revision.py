"""Roofs are never exceeded: a rate above a roof lifts it, the lift is recorded and stated, and no
phase is reported above 100% — at run time (metrics.jsonl, device.json), in `posttrain phases` and in
the report (an unrevised device.json is revised from phases.jsonl)."""

from __future__ import annotations

import io
import json
import re
import time

import pytest
from rich.console import Console

from posttrain.report import load_run, summarize, write_report
from posttrain.telemetry import Telemetry, devices
from posttrain.telemetry.cli import phases_command
from posttrain.telemetry.costs import Cost
from posttrain.telemetry.devices import Peaks
from posttrain.telemetry.phases import PhaseRecord
from posttrain.telemetry.revision import Announcer, net, revise

G = 1e9


def _rec(seconds: float, flops: float, nbytes: float, step: int = 1, name: str = "update") -> PhaseRecord:
    return PhaseRecord("sft", step, name, 0.0, seconds, flops, nbytes, None, None)


def test_revise_lifts_to_the_best_rate_once_per_excess():
    peaks = Peaks(name="x", kind="cpu", flops={"fp32": 100 * G}, bytes_per_s=10 * G)
    # rates 50, 150, 120 GFLOP/s: only 150 lifts (120 is then under the roof); bytes 1, 12 GB/s: 12 lifts
    records = [_rec(1.0, 50 * G, 1 * G, 1), _rec(1.0, 150 * G, 12 * G, 2), _rec(1.0, 120 * G, 5 * G, 3)]
    out, revisions = revise(peaks, "fp32", records)
    assert out.flops["fp32"] == 150 * G and out.bytes_per_s == 12 * G
    assert peaks.flops["fp32"] == 100 * G   # pure: the input is not touched
    assert [(r.roof, r.old, r.new, r.step) for r in revisions] == [("compute", 100 * G, 150 * G, 2),
                                                                  ("bandwidth", 10 * G, 12 * G, 2)]
    # two lifts of one roof net to one: from the first old to the last new
    more = revisions + revise(out, "fp32", [_rec(1.0, 180 * G, 0.0, 4)])[1]
    assert [(r.roof, r.old, r.new, r.step) for r in net(more)] == [("compute", 100 * G, 180 * G, 4),
                                                                  ("bandwidth", 10 * G, 12 * G, 2)]
    # unknown peaks are never revised (nothing to be above)
    assert revise(Peaks(name="?", kind="?"), "fp32", records)[1] == []


def test_a_phase_cannot_be_reported_above_100_percent(tmp_path):
    # A roof of 1 GFLOP/s and 1 GB/s; a phase declaring 2e9 FLOPs and 2e8 bytes over ≥ 0.2 s does at most
    # 10 GFLOP/s (1,000%) — it lifts the compute roof to its own rate, so it reads exactly 100%.
    seen = []
    tele = Telemetry.open(tmp_path, peaks=Peaks(name="slow", kind="cpu", flops={"fp32": 1 * G}, bytes_per_s=1 * G,
                                                 source="test"), busy=False, on_revision=seen.append)
    with tele.phase("update", stage="sft", step=1, cost=Cost(2e9, 2e8)):
        time.sleep(0.2)
    m = tele.step_metrics(stage="sft", step=1)
    tele.close()
    assert m["phase/update/pct_compute_roof"] == pytest.approx(100.0)
    assert m["phase/update/pct_bandwidth_roof"] <= 100.0           # ≤ 1 GB/s: the bandwidth roof held
    assert [r.roof for r in seen] == ["compute"] and seen[0].old == 1 * G and 1 * G < seen[0].new <= 10 * G
    device = json.loads((tmp_path / "device.json").read_text())
    assert device["peaks"]["flops"]["fp32"] == pytest.approx(seen[0].new)
    assert device["revisions"][0]["roof"] == "compute" and device["revisions"][0]["old"] == 1 * G

    # the CLI and the report agree: ≤ 100%, and the revision is stated
    console = Console(width=160, record=True, file=io.StringIO())
    phases_command(tmp_path, console=console)
    text = console.export_text()
    assert "roof revised: fp32 compute roof revised from 1 to" in text
    figures = [float(x) for line in text.splitlines() if "revised" not in line for x in re.findall(r"([\d.]+)%", line)]
    assert figures and max(figures) <= 100.0   # (the revision line itself says by how much the old roof was beaten)
    run = load_run(tmp_path)
    row = summarize(run)[0].phases[0]
    assert row.pct_compute_roof == pytest.approx(100.0) and row.efficiency <= 1.0
    page = write_report(tmp_path).read_text()
    assert "Roof revised: fp32 compute roof revised from 1 to" in page and ">revised<" in page


def test_the_report_revises_a_device_json_the_run_did_not(tmp_path):
    # phases.jsonl written with a roof of 1 GFLOP/s in device.json and no revision (an older run):
    # 4 GFLOP/s in 1 s → the report lifts the roof to 4 GFLOP/s and says so.
    (tmp_path / "device.json").write_text(json.dumps({"name": "old", "kind": "cpu", "dtype": "fp32", "source": "t",
                                                      "peaks": {"flops": {"fp32": 1 * G}, "bytes_per_s": 10 * G}}))
    (tmp_path / "phases.jsonl").write_text(json.dumps(_rec(1.0, 4 * G, 0.1 * G).to_json()) + "\n")
    run = load_run(tmp_path)
    assert run.peak_flops == 4 * G and [(r.old, r.new) for r in run.revisions] == [(1 * G, 4 * G)]
    assert summarize(run)[0].phases[0].pct_compute_roof == pytest.approx(100.0)
    assert "Roof revised" in write_report(tmp_path).read_text()


def test_cpu_cache_keeps_load_and_observed_lifts(tmp_path, monkeypatch):
    monkeypatch.setenv(devices.ENV_CACHE_DIR, str(tmp_path))
    measured = devices.measure_cpu_peaks(matmul_n=128, stream_mib=8, seconds_each=0.06, dtypes=("fp32",), rounds=2)
    obj = json.loads(devices.cache_path().read_text())
    assert obj["method"] == devices.MEASURE_METHOD and "load_per_core" in obj["load"]
    assert "interleaved over 2 rounds" in measured.source and "load average" in measured.source
    # a run observed 3× the measured rate: the next run starts from it, and says why
    rev = revise(measured, "fp32", [_rec(1.0, 3 * measured.flops["fp32"], 0.0)])[1]
    devices.note_observed(measured, "fp32", rev)
    again = devices.load_cpu_peaks()
    assert again.flops["fp32"] == pytest.approx(3 * measured.flops["fp32"])
    assert "lifted to the best rate a run's phase achieved" in again.source
    # a measurement taken under load (2.0 per core) is worth repeating once the machine is quiet (0.1)
    obj = json.loads(devices.cache_path().read_text())
    obj["load"]["load_per_core"] = 2.0
    assert devices.measured_under_load(obj, now={"load_per_core": 0.1})
    assert not devices.measured_under_load(obj, now={"load_per_core": 1.9})   # still as busy: keep it
    obj["load"]["load_per_core"] = 0.2
    assert not devices.measured_under_load(obj, now={"load_per_core": 0.0})   # measured quiet: keep it
    # a re-measurement never lowers a roof: a previous, faster figure is kept and said so
    remeasured = devices.measure_cpu_peaks(matmul_n=128, stream_mib=8, seconds_each=0.06, dtypes=("fp32",), rounds=2)
    assert remeasured.flops["fp32"] >= measured.flops["fp32"]


def test_announcer_says_the_first_lift_and_big_rises_only():
    said: list[str] = []
    say = Announcer(said.append, factor=1.25)
    peaks = Peaks(name="x", kind="cpu", flops={"fp32": 100 * G}, bytes_per_s=10 * G)
    # lifts to 110, 120, 130, 140 GFLOP/s: said at 110 (first), then at ≥ 110 × 1.25 = 137.5 → 140
    for step, rate in enumerate((110, 120, 130, 140), 1):
        for r in revise(peaks, "fp32", [_rec(1.0, rate * G, 0.0, step)])[1]:
            say(r)
            peaks.flops["fp32"] = r.new
    assert len(said) == 2 and "to 110 GFLOP/s" in said[0] and "to 140 GFLOP/s" in said[1]
