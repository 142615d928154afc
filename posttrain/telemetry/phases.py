"""Phases: `with tele.phase("generate", stage=…, step=…, cost=…)` → one record on the roofline.

Each phase records its wall time (device-synchronized at both boundaries on a GPU — two sync points
per phase, which is the price of honest timing), the FLOPs and bytes the caller says it did (from
`posttrain.telemetry.costs`), and the busy line's mean over it. Phases nest: a phase's `seconds` is
exclusive (its children's time is subtracted), its cost is only what was given to it, and its
`parent` names the enclosing phase. Records are appended to `phases.jsonl`; `step_metrics` folds a
step's records into the flat `phase/<name>/…` keys of `metrics.jsonl` (docs/run_dir.md).

Departures:
1. Time is `time.perf_counter()` relative to `started` (the run's start, on the same clock);
   `start` in a record is therefore seconds since the run started, as the run-dir contract says.
2. A phase whose block raises is still recorded (its time was spent), then the exception propagates.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.telemetry.busy import BusySampler, BusySource, source_for
from posttrain.telemetry.costs import Cost, dtype_name
from posttrain.telemetry.devices import Peaks, detect
from posttrain.telemetry.roofline import OVERHEAD_BELOW, place
from posttrain.telemetry.sinks import JsonlSink, read_jsonl_records

STANDARD_PHASES = ("generate", "score", "reference", "update", "sync", "eval")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class PhaseRecord:
    """One phase occurrence: the phases.jsonl line of docs/run_dir.md."""

    stage: str
    step: int
    name: str
    start: float         # seconds since the run started
    seconds: float       # exclusive wall time
    flops: float
    bytes: float
    busy: float | None   # mean busy (0..1) over the phase, None when no sample fell inside
    parent: str | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "phases.jsonl") -> PhaseRecord:
        try:
            return cls(stage=str(obj["stage"]), step=int(obj["step"]), name=str(obj["name"]),
                       start=float(obj["start"]), seconds=float(obj["seconds"]), flops=float(obj["flops"]),
                       bytes=float(obj["bytes"]), busy=None if obj.get("busy") is None else float(obj["busy"]),
                       parent=obj.get("parent"))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{where}: bad phase record {obj!r}: {err!r}; expected the fields "
                             "stage, step, name, start, seconds, flops, bytes, busy, parent") from None


def read_phases(path: str | Path) -> list[PhaseRecord]:
    """Read phases.jsonl, tolerating a truncated last line (a killed run) and nothing else."""
    return [PhaseRecord.from_json(obj, where=f"{path}:{line}") for line, obj in read_jsonl_records(path)]


@dataclass
class Phase:
    """The handle a `with tele.phase(...)` block gets: give or add the cost after the fact."""

    name: str
    stage: str
    step: int
    cost: Cost | None = None
    _start: float = 0.0
    _children: list[tuple[float, float]] = field(default_factory=list)
    _child_seconds: float = 0.0

    def add(self, cost: Cost) -> None:
        self.cost = cost if self.cost is None else self.cost + cost


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    if device.type == "xpu":
        return lambda: torch.xpu.synchronize(device)
    return lambda: None


class Telemetry:
    """Times phases, places them on the device roofline, writes phases.jsonl and device.json."""

    def __init__(self, *, peaks: Peaks, dtype: str, run_dir: Path | None = None,
                 sampler: BusySampler | None = None, sync: Callable[[], None] = lambda: None,
                 started: float | None = None, overhead_below: float = OVERHEAD_BELOW,
                 enabled: bool = True) -> None:
        self.peaks, self.dtype, self.run_dir = peaks, dtype, run_dir
        self.sampler, self._sync = sampler, sync
        self.started = time.perf_counter() if started is None else started
        self.overhead_below, self.enabled = overhead_below, enabled
        self._stack = threading.local()
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], list[PhaseRecord]] = {}
        self._windows: dict[tuple[str, int], tuple[float, float]] = {}
        self._open: dict[int, float] = {}  # id(handle) → start, for phases still running (any thread)
        self._sink = JsonlSink(run_dir / "phases.jsonl") if run_dir is not None and enabled else None

    @classmethod
    def open(cls, run_dir: str | Path | None, *, device: torch.device | str = "cpu",
             dtype: torch.dtype | str = torch.float32, peaks: Peaks | None = None,
             peak_flops: float | None = None, peak_bytes_per_s: float | None = None,
             measure_cpu: bool = False, busy: bool = True, busy_hz: float = 20.0,
             busy_source: BusySource | None = None, started: float | None = None) -> Telemetry:
        """Detect the device's peaks, write device.json, start the busy sampler.

        `peaks` replaces detection entirely; `peak_flops`/`peak_bytes_per_s` override single roofs
        (the recipe's fields). `busy=False` runs no sampler; `busy_source` replaces the device's
        default (NVML on NVIDIA, process CPU time on a CPU). `started` is the run's start on the
        `time.perf_counter()` clock.
        """
        device = torch.device(device)
        dt = dtype_name(dtype)
        if peaks is None:
            peaks = detect(device, dt, peak_flops=peak_flops, peak_bytes_per_s=peak_bytes_per_s,
                           measure_cpu=measure_cpu)
        run = Path(run_dir) if run_dir is not None else None
        if run is not None:
            run.mkdir(parents=True, exist_ok=True)
            (run / "device.json").write_text(json.dumps(peaks.to_json(dt), indent=2) + "\n")
        source = (busy_source if busy_source is not None else source_for(device)) if busy else None
        sampler = BusySampler(source, hz=busy_hz) if source is not None else None
        return cls(peaks=peaks, dtype=dt, run_dir=run, sampler=sampler, sync=_synchronizer(device),
                   started=started)

    @classmethod
    def disabled(cls) -> Telemetry:
        """A Telemetry whose phases cost nothing and record nothing (stages run without a run dir)."""
        return cls(peaks=Peaks(name="none", kind="none"), dtype="fp32", enabled=False)

    # ---- phases ---------------------------------------------------------------------------------
    def _frames(self) -> list[Phase]:
        frames = getattr(self._stack, "frames", None)
        if frames is None:
            frames = self._stack.frames = []
        return frames

    @contextmanager
    def phase(self, name: str, *, stage: str, step: int, cost: Cost | None = None) -> Iterator[Phase]:
        """Time the block as phase `name` of `stage`'s step `step`; `cost` may be set on the handle later."""
        handle = Phase(name=name, stage=stage, step=step, cost=cost)
        if not self.enabled:
            yield handle
            return
        if not _NAME.match(name):
            raise ValueError(f"phase name {name!r}: expected lowercase letters, digits and '_' "
                             f"(standard names: {', '.join(STANDARD_PHASES)})")
        frames = self._frames()
        self._sync()  # device sync point: work queued before the phase is not billed to it
        handle._start = time.perf_counter()
        frames.append(handle)
        with self._lock:
            self._open[id(handle)] = handle._start
        try:
            yield handle
        finally:
            self._sync()  # device sync point: the phase's kernels have finished
            end = time.perf_counter()
            frames.pop()
            parent = frames[-1] if frames else None
            if parent is not None:
                parent._children.append((handle._start, end))
                parent._child_seconds += end - handle._start
            self._record(handle, end, parent.name if parent is not None else None)

    def _record(self, handle: Phase, end: float, parent: str | None) -> None:
        cost = handle.cost or Cost()
        busy = self.sampler.mean(handle._start, end, handle._children) if self.sampler else None
        record = PhaseRecord(stage=handle.stage, step=handle.step, name=handle.name,
                             start=handle._start - self.started, seconds=end - handle._start - handle._child_seconds,
                             flops=float(cost.flops), bytes=float(cost.bytes), busy=busy, parent=parent)
        key = (handle.stage, handle.step)
        with self._lock:
            self._open.pop(id(handle), None)
            self._pending.setdefault(key, []).append(record)
            lo, hi = self._windows.get(key, (handle._start, end))
            self._windows[key] = (min(lo, handle._start), max(hi, end))
            if self._sink is not None:
                self._sink.log(record.to_json())

    def records(self, stage: str, step: int) -> list[PhaseRecord]:
        """The records of a step not yet folded by `step_metrics`."""
        with self._lock:
            return list(self._pending.get((stage, step), []))

    # ---- per-step aggregation -------------------------------------------------------------------
    def step_metrics(self, *, stage: str, step: int) -> dict[str, float | str]:
        """Fold the step's phase records into metrics.jsonl keys, and forget them.

        Per phase name: `phase/<name>/seconds` (sum of exclusive time), `…/flops_per_s`,
        `…/bytes_per_s`, `…/intensity`, `…/pct_compute_roof`, `…/pct_bandwidth_roof` (0..100),
        `…/bound`, `…/busy` (time-weighted over occurrences); plus `telemetry/busy`, the busy mean
        over the whole step. Keys whose value is undefined (no cost, unknown peak) are left out.
        """
        if not self.enabled:
            return {}
        with self._lock:
            records = self._pending.pop((stage, step), [])
            window = self._windows.pop((stage, step), None)
        by_name: dict[str, list[PhaseRecord]] = {}
        for r in records:
            by_name.setdefault(r.name, []).append(r)
        peak_flops = self.peaks.flops_for(self.dtype)
        out: dict[str, float | str] = {}
        for name, group in by_name.items():
            seconds = sum(r.seconds for r in group)
            flops, nbytes = sum(r.flops for r in group), sum(r.bytes for r in group)
            p = place(flops, nbytes, seconds, peak_flops=peak_flops, peak_bytes_per_s=self.peaks.bytes_per_s,
                      overhead_below=self.overhead_below)
            values: dict[str, float | str | None] = {
                "seconds": seconds, "flops_per_s": p.flops_per_s, "bytes_per_s": p.bytes_per_s,
                "intensity": p.intensity, "pct_compute_roof": p.pct_compute_roof,
                "pct_bandwidth_roof": p.pct_bandwidth_roof, "bound": p.bound.value,
                "busy": _time_weighted_busy(group),
            }
            out.update({f"phase/{name}/{k}": v for k, v in values.items() if v is not None})
        if self.sampler is not None and window is not None:
            busy = self.sampler.mean(*window)
            if busy is not None:
                out["telemetry/busy"] = busy
            with self._lock:  # keep samples any unfinished phase or unfolded step may still need
                keep_from = [w[0] for w in self._windows.values()] + list(self._open.values())
            self.sampler.prune(min(keep_from + [window[1]]))
        return out

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        if self._sink is not None:
            self._sink.close()


def _time_weighted_busy(records: list[PhaseRecord]) -> float | None:
    timed = [(r.seconds, r.busy) for r in records if r.busy is not None]
    total = sum(s for s, _ in timed)
    if not timed:
        return None
    if total <= 0:
        return sum(b for _, b in timed) / len(timed)
    return sum(s * b for s, b in timed) / total
