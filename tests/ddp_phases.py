"""One rank of tests/test_telemetry_ranks.py's 2-process gloo gather of phase records (spawned; imports
only torch and posttrain.telemetry, so a child starts in seconds)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as tdist

from posttrain.telemetry.devices import Peaks
from posttrain.telemetry.phases import PhaseRecord, Telemetry
from posttrain.telemetry.ranks import RankTelemetry, gather_phases


def gather(rank: int, port: int, base: float, run_dir: str) -> None:
    """Rank 0 writes `run_dir`/phases.jsonl; rank 1's run "started" 10 s before rank 0's (`base` − 10 on
    the shared monotonic clock), so its record at 12.0 s lands at 2.0 s on rank 0's clock."""
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 0:
            tele: Telemetry = Telemetry(peaks=Peaks(name="test", kind="cpu", flops={"fp32": 1e12}, bytes_per_s=1e11),
                                        dtype="fp32", run_dir=Path(run_dir), started=base)
            with tele.phase("update", stage="sft", step=1):
                pass
        else:
            tele = RankTelemetry(rank=1, started=base - 10.0, memory=False)
            tele.record_external(PhaseRecord(stage="sft", step=1, name="update", start=12.0, seconds=0.5,
                                             flops=1e9, bytes=0.0, busy=None, parent=None))
            with tele.phase("sync", stage="sft", step=1):  # timed here: relabelled rank1 too
                pass
            assert tele.step_metrics(stage="sft", step=1) == {}  # a rank > 0 logs nothing itself
        added = gather_phases(tele, rank=rank, world_size=2)
        assert added == (2 if rank == 0 else 0), added
        if rank == 0:
            # the step's metrics fold each rank apart: rank 0's update (≈ 0 s) under phase/, rank 1's 0.5 s
            # under phase@rank1/ (never summed)
            m = tele.step_metrics(stage="sft", step=1)
            assert m["phase/update/seconds"] < 0.1 and m["phase@rank1/update/seconds"] == 0.5, m
            tele.close()
        else:
            assert tele.drain() == []  # drained by the gather: nothing is sent twice
        assert gather_phases(tele, rank=rank, world_size=2) == 0  # nothing new anywhere
    finally:
        tdist.destroy_process_group()
