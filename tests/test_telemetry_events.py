"""CUDA-event phase timing, dry-run on a CPU with a stand-in event: no device sync per phase, times read
when the step is folded, exclusive time under nesting as with synchronized timing."""

from __future__ import annotations

import time

import pytest

from posttrain.telemetry import Telemetry
from posttrain.telemetry.costs import Cost
from posttrain.telemetry.devices import Peaks

PEAKS = Peaks(name="synthetic", kind="cuda", flops={"bf16": 1e15}, bytes_per_s=1e15, source="test")


class FakeEvent:
    """torch.cuda.Event's surface: record() stamps the host clock; elapsed_time() in milliseconds."""

    waits = 0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        FakeEvent.waits += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1e3 * (end.t - self.t)


def test_event_timing_defers_records_and_never_syncs_per_phase(tmp_path):
    syncs = []
    tele = Telemetry(peaks=PEAKS, dtype="bf16", run_dir=tmp_path, sync=lambda: syncs.append(1), timing="events",
                     event_factory=FakeEvent)
    FakeEvent.waits = 0
    for _ in range(3):
        with tele.phase("generate", stage="grpo", step=1):
            time.sleep(0.02)
            with tele.phase("score", stage="grpo", step=1, cost=Cost(1.0, 1.0)):
                time.sleep(0.03)
    assert syncs == []                                   # timing="events": no synchronize at any boundary
    assert (tmp_path / "phases.jsonl").read_text() == ""  # nothing read yet: no wait on the device
    m = tele.step_metrics(stage="grpo", step=1)
    tele.close()
    assert FakeEvent.waits == 6                          # each phase's end event read once, at the fold
    # 3 × (generate ≥ 0.02 s exclusive, score ≥ 0.03 s): the child's time is not the parent's
    assert 0.06 <= m["phase/generate/seconds"] < 0.09 + 0.05
    assert m["phase/score/seconds"] >= 0.09
    assert len((tmp_path / "phases.jsonl").read_text().splitlines()) == 6


def test_timing_mode_is_checked():
    with pytest.raises(ValueError, match="timing='later'"):
        Telemetry(peaks=PEAKS, dtype="bf16", timing="later")
