"""Phases: exclusive time under nesting, records on disk in the run-dir format, per-step metrics."""

from __future__ import annotations

import json
import time

import pytest

from posttrain.telemetry import Telemetry
from posttrain.telemetry.costs import Cost
from posttrain.telemetry.devices import Peaks
from posttrain.telemetry.phases import PhaseRecord, read_phases

# P = 100 GFLOP/s, B = 10 GB/s → ridge 10 FLOP/byte
PEAKS = Peaks(name="synthetic", kind="cpu", flops={"fp32": 100e9}, bytes_per_s=10e9, source="test")


class Constant:
    name = "constant"

    def __init__(self, value: float) -> None:
        self.value = value

    def read(self) -> float | None:
        return self.value

    def close(self) -> None:
        pass


def _open(tmp_path, busy: float | None = 0.9) -> Telemetry:
    return Telemetry.open(tmp_path, device="cpu", dtype="fp32", peaks=PEAKS, busy=busy is not None,
                          busy_source=Constant(busy) if busy is not None else None, busy_hz=50.0)


def test_device_json_and_record_format(tmp_path):
    tele = _open(tmp_path)
    with tele.phase("update", stage="sft", step=1, cost=Cost(2e8, 1e7)):  # ≤ 20 GFLOP/s, 1 GB/s: under both roofs
        time.sleep(0.01)
    tele.close()
    device = json.loads((tmp_path / "device.json").read_text())
    assert device == {"name": "synthetic", "kind": "cpu", "peaks": {"flops": {"fp32": 100e9}, "bytes_per_s": 10e9},
                      "source": "test", "dtype": "fp32", "timing": "sync", "memory": device["memory"]}
    assert device["memory"] in ("rss", "rss-sampled")
    lines = (tmp_path / "phases.jsonl").read_text().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert set(obj) == {"stage", "step", "name", "start", "seconds", "flops", "bytes", "busy", "parent",
                        "mem_peak", "mem_start"}
    assert (obj["stage"], obj["step"], obj["name"], obj["flops"], obj["bytes"], obj["parent"]) == (
        "sft", 1, "update", 2e8, 1e7, None)
    assert obj["mem_peak"] >= obj["mem_start"] > 0
    assert 0.01 <= obj["seconds"] < 0.5 and obj["start"] >= 0


def test_nesting_subtracts_inner_time(tmp_path):
    tele = _open(tmp_path, busy=None)
    with tele.phase("generate", stage="grpo", step=1):
        time.sleep(0.05)
        with tele.phase("score", stage="grpo", step=1, cost=Cost(1.0, 1.0)):
            time.sleep(0.10)
    records = {r.name: r for r in tele.records("grpo", 1)}
    tele.close()
    # outer ran ≥ 0.15 s in total, of which ≥ 0.10 s inside `score`: exclusive ≈ 0.05 s
    assert 0.05 <= records["generate"].seconds < 0.10
    assert records["score"].seconds >= 0.10
    assert records["score"].parent == "generate" and records["generate"].parent is None
    assert records["generate"].flops == 0.0  # the child's cost is not the parent's


def test_cost_given_after_the_fact_and_added(tmp_path):
    tele = _open(tmp_path, busy=None)
    with tele.phase("generate", stage="grpo", step=2) as p:
        p.cost = Cost(10.0, 5.0)
        p.add(Cost(1.0, 1.0))
    with tele.phase("generate", stage="grpo", step=2) as p:
        p.add(Cost(4.0, 4.0))
    records = tele.records("grpo", 2)
    tele.close()
    assert [(r.flops, r.bytes) for r in records] == [(11.0, 6.0), (4.0, 4.0)]


def test_step_metrics_keys_and_values(tmp_path):
    tele = _open(tmp_path, busy=0.9)
    with tele.phase("update", stage="sft", step=3, cost=Cost(1e9, 1e7)):  # I = 100 FLOP/B
        time.sleep(0.1)
    with tele.phase("eval", stage="sft", step=3):  # no cost given
        time.sleep(0.01)
    metrics = tele.step_metrics(stage="sft", step=3)
    again = tele.step_metrics(stage="sft", step=3)
    tele.close()
    seconds = metrics["phase/update/seconds"]
    assert 0.1 <= seconds < 0.5
    assert metrics["phase/update/flops_per_s"] == pytest.approx(1e9 / seconds)
    assert metrics["phase/update/intensity"] == pytest.approx(100.0)
    # ≤ 10 GFLOP/s achieved of 100 → ≤ 10% of the compute roof, efficiency < 0.25 → overhead
    assert metrics["phase/update/pct_compute_roof"] == pytest.approx(100 * 1e9 / seconds / 100e9)
    assert metrics["phase/update/bound"] == "overhead"
    assert metrics["phase/update/busy"] == pytest.approx(0.9)
    assert metrics["telemetry/busy"] == pytest.approx(0.9)
    assert metrics["phase/eval/bound"] == "unknown" and "phase/eval/flops_per_s" not in metrics
    assert again == {}  # folded records are forgotten


def test_fast_phase_places_as_compute_bound(tmp_path):
    # a synthetic 'fast' phase: claim 8 GFLOP in ≥ 0.1 s is ≤ 80 GFLOP/s; sleep 0.1 s → ~80% of P at I=100
    tele = _open(tmp_path, busy=None)
    with tele.phase("update", stage="sft", step=1, cost=Cost(8e9, 8e7)):
        time.sleep(0.1)
    metrics = tele.step_metrics(stage="sft", step=1)
    tele.close()
    expected_pct = 100 * 8e9 / metrics["phase/update/seconds"] / 100e9
    assert metrics["phase/update/pct_compute_roof"] == pytest.approx(expected_pct)
    # on a loaded machine sleep overshoots; the verdict holds while efficiency ≥ 0.25 (seconds ≤ 0.32)
    assert metrics["phase/update/bound"] == ("compute" if expected_pct >= 25 else "overhead")
    assert "telemetry/busy" not in metrics  # no busy source → no busy keys


def test_phase_is_recorded_when_the_block_raises(tmp_path):
    tele = _open(tmp_path, busy=None)
    with pytest.raises(RuntimeError, match="boom"), tele.phase("update", stage="sft", step=1):
        raise RuntimeError("boom")
    assert [r.name for r in tele.records("sft", 1)] == ["update"]
    tele.close()


def test_bad_phase_name(tmp_path):
    tele = _open(tmp_path, busy=None)
    with pytest.raises(ValueError, match="phase name 'Update/x'"), tele.phase("Update/x", stage="sft", step=1):
        pass
    tele.close()


def test_default_cpu_busy_source_samples(tmp_path):
    tele = Telemetry.open(tmp_path, device="cpu", dtype="fp32", peaks=PEAKS)
    end = time.perf_counter() + 0.3
    with tele.phase("update", stage="sft", step=1):
        while time.perf_counter() < end:
            pass  # keep a core busy
    metrics = tele.step_metrics(stage="sft", step=1)
    tele.close()
    # the CPU source is on by default and reads a 0..1 fraction (the value depends on machine load)
    assert 0.0 < metrics["phase/update/busy"] <= 1.0


def test_disabled_telemetry_records_nothing(tmp_path):
    tele = Telemetry.disabled()
    with tele.phase("update", stage="sft", step=1, cost=Cost(1.0, 1.0)) as p:
        p.add(Cost(1.0, 1.0))
    assert tele.step_metrics(stage="sft", step=1) == {}
    tele.close()


def test_read_phases_tolerates_only_a_truncated_last_line(tmp_path):
    good = PhaseRecord("sft", 1, "update", 0.0, 1.0, 2.0, 3.0, None, None).to_json()
    path = tmp_path / "phases.jsonl"
    path.write_text(json.dumps(good) + "\n" + '{"stage": "sft", "st')
    assert read_phases(path) == [PhaseRecord("sft", 1, "update", 0.0, 1.0, 2.0, 3.0, None, None)]
    path.write_text('{"stage": "sft", "st\n' + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match="phases.jsonl:1: not valid JSON"):
        read_phases(path)
    path.write_text(json.dumps({"stage": "sft"}) + "\n")
    with pytest.raises(ValueError, match="bad phase record"):
        read_phases(path)


def test_worker_thread_phases_do_not_nest_and_carry_their_worker(tmp_path):
    """A rollout thread's phase overlaps the learner's: it is its own record (parent None, worker
    "rollout0"), and the learner's phase keeps its whole time (nothing subtracted for the thread's)."""
    import threading
    tele = _open(tmp_path, busy=None)
    started = threading.Event()

    def rollout() -> None:
        with tele.phase("generate", stage="grpo", step=2, worker="rollout0"):
            started.set()
            time.sleep(0.05)

    with tele.phase("update", stage="grpo", step=1):
        th = threading.Thread(target=rollout)
        th.start()
        started.wait()
        th.join()
    tele.close()
    recs = {r.name: r for r in read_phases(tmp_path / "phases.jsonl")}
    assert recs["generate"].worker == "rollout0" and recs["generate"].parent is None
    assert recs["update"].worker == "main" and recs["update"].seconds >= 0.05  # not reduced by the thread's phase
    raw = [json.loads(line) for line in (tmp_path / "phases.jsonl").read_text().splitlines()]
    assert [("worker" in o) for o in raw] == [True, False]  # "main" is not written: old readers see old records


def test_record_external_is_written_and_folded_into_its_step(tmp_path):
    """A phase timed in another process (a Ray actor) joins its step like a local one — under its worker's
    keys, apart from the main worker's phase of the same name (the learner's wait for that rollout)."""
    tele = _open(tmp_path, busy=None)
    tele.record_external(PhaseRecord("grpo", 3, "generate", 1.0, 2.0, 4e9, 2e9, None, None, worker="rollout1"))
    with tele.phase("generate", stage="grpo", step=3):  # the learner's side of the same rollout
        pass
    m = tele.step_metrics(stage="grpo", step=3)
    tele.close()
    assert m["phase@rollout1/generate/seconds"] == 2.0
    assert m["phase@rollout1/generate/flops_per_s"] == pytest.approx(2e9)  # 4 GFLOP in 2 s
    assert m["phase/generate/seconds"] < 0.1  # the learner's own: not 2 s more
    assert read_phases(tmp_path / "phases.jsonl")[0].worker == "rollout1"
