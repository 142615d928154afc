"""Every data-parallel rank's phases in the run's one phases.jsonl.

Rank 0 alone writes the run folder (docs/distributed.md). The other ranks time their phases in memory
(`RankTelemetry`: a `Telemetry` with no run folder whose records are kept until gathered, each
relabelled worker `rank<r>`; the pipeline makes one on every rank > 0), and at every logged step all ranks meet in `gather_phases` — one
`torch.distributed.gather_object` to rank 0 — where rank 0 maps each record onto its own clock and adds
it with `Telemetry.record_external`: written to phases.jsonl, folded into the step's metrics under
`phase@rank<r>/…` (rank 0's own stay `phase/…`), and drawn as its own lane in the report
(posttrain/telemetry/lanes.py).

The collective is a synchronization point: every rank must call `gather_phases` at the same logged
steps, in the same order — `RunContext.log` calls it, so the stages log at rank-independent steps.

Clocks: each process's `start` is seconds since its own `started` (perf_counter, after the ranks'
start-up barrier). A rank sends, with its records, the wall-clock time of its `started`; rank 0 shifts
a record by the difference of the two wall-clock starts. On one machine this is exact to the clock's
resolution; across machines it is as good as their clocks' synchronization (NTP: about a millisecond).

Departures from rank 0's telemetry: a rank > 0 runs no busy sampler (its records' `busy` is null —
rank 0's sampler is the run's busy line; on a CPU every rank shares its cores anyway) and its local
roof revisions are dropped (rank 0 revises its roofs from the gathered records, as from its own).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as tdist

from posttrain.telemetry.devices import Peaks
from posttrain.telemetry.memory import SampledRss, meter_for
from posttrain.telemetry.phases import ENV_SYNC_PHASES, MAIN_WORKER, PhaseRecord, Telemetry, _synchronizer


def rank_worker(rank: int) -> str:
    """The worker name of a data-parallel rank's phases: rank 0 is the run's `main`, rank r is `rank<r>`."""
    return MAIN_WORKER if rank == 0 else f"rank{rank}"


def wall_start(started: float) -> float:
    """The wall-clock time (time.time()) at which `started` (a perf_counter reading) was."""
    return time.time() - (time.perf_counter() - started)


class RankTelemetry(Telemetry):
    """A rank > 0's telemetry: phases timed as on rank 0, nothing written, records kept until `drain`."""

    def __init__(self, *, rank: int, started: float, device: torch.device | str = "cpu", dtype: str = "fp32",
                 memory: bool = True, timing: str | None = None) -> None:
        device = torch.device(device)
        if timing is None:  # rank 0's rule (Telemetry.open): CUDA events unless POSTTRAIN_SYNC_PHASES=1
            timing = "events" if device.type == "cuda" and os.environ.get(ENV_SYNC_PHASES) != "1" else "sync"
        meter = meter_for(device) if memory else None
        if isinstance(meter, SampledRss):
            meter = None  # sampled RSS needs the busy sampler's ticks, which a rank > 0 does not run
        super().__init__(peaks=Peaks(name=f"rank{rank}", kind="none"), dtype=dtype, run_dir=None, sampler=None,
                         sync=_synchronizer(device) if timing == "sync" else (lambda: None), started=started,
                         memory=meter, timing=timing,
                         on_revision=lambda revision: None)
        self.rank, self.worker = rank, rank_worker(rank)
        self.wall_start = wall_start(started)
        self._kept: list[PhaseRecord] = []

    def _add(self, record: PhaseRecord, start: float, end: float) -> None:
        if record.worker == MAIN_WORKER:
            record = replace(record, worker=self.worker)
        super()._add(record, start, end)
        with self._lock:
            self._kept.append(record)

    def step_metrics(self, *, stage: str, step: int) -> dict[str, float | str]:
        super().step_metrics(stage=stage, step=step)  # forget the step (rank 0 folds the gathered records)
        return {}

    def drain(self) -> list[PhaseRecord]:
        """The records timed since the last drain, in the order they ended (event timing: read first)."""
        if self._deferred:
            self._resolve()
        with self._lock:
            out, self._kept = self._kept, []
        return out


def gather_phases(telemetry: Telemetry, *, rank: int, world_size: int) -> int:
    """One `gather_object` to rank 0 of every rank's records since the last call; rank 0 adds them
    (`record_external`). Every rank must call it (a sync point). Returns the records rank 0 added (0
    elsewhere, and in a one-process run, which calls nothing)."""
    if world_size <= 1:
        return 0
    mine: list[dict[str, Any]] = [r.to_json() for r in telemetry.drain()] if isinstance(telemetry, RankTelemetry) else []
    payload = (wall_start(telemetry.started), mine)
    received: list[Any] | None = [None] * world_size if rank == 0 else None
    tdist.gather_object(payload, received, dst=0)  # a sync point with every rank
    if rank != 0 or received is None:
        return 0
    here, added = payload[0], 0
    for r, item in enumerate(received):
        if r == 0 or item is None:
            continue
        their_start, records = item
        shift = their_start - here  # seconds from rank 0's start to rank r's
        for obj in records:
            record = PhaseRecord.from_json(obj, where=f"phases gathered from rank {r}")
            telemetry.record_external(replace(record, start=record.start + shift))
            added += 1
    return added
