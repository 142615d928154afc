"""Phases: `with tele.phase("generate", stage=…, step=…, cost=…)` → one record on the roofline.

Each phase records its wall time (device-synchronized at both boundaries on a GPU — two sync points
per phase, which is the price of honest timing), the FLOPs and bytes the caller says it did (from
`posttrain.telemetry.costs`), and the busy line's mean over it. Phases nest: a phase's `seconds` is
exclusive (its children's time is subtracted), its cost is only what was given to it, and its
`parent` names the enclosing phase. Records are appended to `phases.jsonl`; `step_metrics` folds a
step's records into the flat `phase/<name>/…` keys of `metrics.jsonl` (docs/run_dir.md).

Each phase also records its memory high-water mark (`posttrain.telemetry.memory`: peak RSS on a
CPU, peak allocated/reserved on CUDA), and no phase is ever placed above a roof: a rate above one
lifts it (`posttrain.telemetry.revision`), device.json is rewritten with the revision, and the run
says so.

Departures:
1. Time is `time.perf_counter()` relative to `started` (the run's start, on the same clock);
   `start` in a record is therefore seconds since the run started, as the run-dir contract says.
2. A phase whose block raises is still recorded (its time was spent), then the exception propagates.
3. On CUDA, phases are timed by CUDA events by default (`timing="events"`): an event is recorded at
   each boundary and read when the step's metrics are folded (`step_metrics`, one wait on the last
   event) — no device sync per phase. `timing="sync"` (or POSTTRAIN_SYNC_PHASES=1) synchronizes at
   both boundaries instead, as on other accelerators. With events, a phase's seconds are GPU time
   between its boundaries (host work that queued nothing is not in it), while its busy and memory
   windows are host time.
"""

from __future__ import annotations

import copy
import json
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.telemetry.busy import BusySampler, BusySource, source_for
from posttrain.telemetry.costs import Cost, dtype_name
from posttrain.telemetry.devices import Peaks, detect, note_observed
from posttrain.telemetry.memory import MemoryMeter, PhaseMemory, SampledRss, meter_for
from posttrain.telemetry.revision import Revision, revise_one
from posttrain.telemetry.roofline import OVERHEAD_BELOW, place
from posttrain.telemetry.sinks import JsonlSink, read_jsonl_records

STANDARD_PHASES = ("generate", "tool", "score", "reference", "update", "sync", "eval")
MAIN_WORKER = "main"
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
    mem_peak: int | None = None      # bytes: peak RSS (CPU) or peak allocated (CUDA) during the phase, children included
    mem_start: int | None = None     # bytes in use when it began (mem_peak − mem_start: what the phase added)
    mem_reserved: int | None = None  # CUDA: peak bytes reserved by the caching allocator
    # who ran it: "main" (the one process, or the learner), "rank1" (a data-parallel rank), "rollout0"
    # (a rollout worker: a thread of this process or a Ray actor) — the report draws one timeline per worker
    worker: str = MAIN_WORKER

    def to_json(self) -> dict[str, Any]:
        obj = asdict(self)
        for k in ("mem_peak", "mem_start", "mem_reserved"):
            if obj[k] is None:
                del obj[k]
        if obj["worker"] == MAIN_WORKER:  # the one-process run's records read as they always did
            del obj["worker"]
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "phases.jsonl") -> PhaseRecord:
        try:
            return cls(stage=str(obj["stage"]), step=int(obj["step"]), name=str(obj["name"]),
                       start=float(obj["start"]), seconds=float(obj["seconds"]), flops=float(obj["flops"]),
                       bytes=float(obj["bytes"]), busy=None if obj.get("busy") is None else float(obj["busy"]),
                       parent=obj.get("parent"),
                       mem_peak=None if obj.get("mem_peak") is None else int(obj["mem_peak"]),
                       mem_start=None if obj.get("mem_start") is None else int(obj["mem_start"]),
                       mem_reserved=None if obj.get("mem_reserved") is None else int(obj["mem_reserved"]),
                       worker=str(obj.get("worker", MAIN_WORKER)))
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
    worker: str = MAIN_WORKER
    _start: float = 0.0
    _children: list[tuple[float, float]] = field(default_factory=list)
    _child_seconds: float = 0.0
    _child_handles: list[Phase] = field(default_factory=list)
    _mem_peak: int = 0
    _mem_start: int = 0
    _mem_reserved: int | None = None
    _events: tuple[Any, Any] | None = None   # CUDA timing: (start event, end event)
    _elapsed: float | None = None            # inclusive GPU seconds, once the end event is read

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


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


ENV_SYNC_PHASES = "POSTTRAIN_SYNC_PHASES"
_MAX_DEFERRED = 512  # event-timed phases waiting to be read: past this, read them (one wait) to bound memory


class Telemetry:
    """Times phases, places them on the device roofline, writes phases.jsonl and device.json.

    timing: "sync" (default off CUDA: a device sync at both boundaries; nothing to sync on a CPU) or
    "events" (the CUDA default: `event_factory()` events at the boundaries, read in `step_metrics`).
    memory: the meter of peak memory per phase (None: no memory fields).
    on_revision: called with each `Revision` when a phase's rate lifts a roof (the pipeline prints it;
    the default warns)."""

    def __init__(self, *, peaks: Peaks, dtype: str, run_dir: Path | None = None,
                 sampler: BusySampler | None = None, sync: Callable[[], None] = lambda: None,
                 started: float | None = None, overhead_below: float = OVERHEAD_BELOW,
                 enabled: bool = True, memory: MemoryMeter | None = None, timing: str = "sync",
                 event_factory: Callable[[], Any] = _cuda_event,
                 on_revision: Callable[[Revision], None] | None = None) -> None:
        if timing not in ("sync", "events"):
            raise ValueError(f"Telemetry: timing={timing!r}; expected 'sync' or 'events'")
        self.peaks, self.dtype, self.run_dir = copy.deepcopy(peaks), dtype, run_dir  # a revision lifts our copy
        self.sampler = sampler
        self._sync = sync if timing == "sync" else (lambda: None)  # events: no device sync at the boundaries
        self.started = time.perf_counter() if started is None else started
        self.overhead_below, self.enabled = overhead_below, enabled
        self.memory = PhaseMemory(memory) if memory is not None and enabled else None
        self.timing, self._event = timing, event_factory
        self.revisions: list[Revision] = []
        self.on_revision = on_revision or (lambda r: warnings.warn(r.sentence(), stacklevel=4))
        self._stack = threading.local()
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], list[PhaseRecord]] = {}
        self._windows: dict[tuple[str, int], tuple[float, float]] = {}
        self._open: dict[int, float] = {}  # id(handle) → start, for phases still running (any thread)
        self._deferred: list[tuple[Phase, float, str | None, float | None, Any]] = []  # event-timed, unread
        self._sink = JsonlSink(run_dir / "phases.jsonl") if run_dir is not None and enabled else None
        self._memory_sink: JsonlSink | None = None  # memory.jsonl, opened by the first `note_consumers`

    @classmethod
    def open(cls, run_dir: str | Path | None, *, device: torch.device | str = "cpu",
             dtype: torch.dtype | str = torch.float32, peaks: Peaks | None = None,
             peak_flops: float | None = None, peak_bytes_per_s: float | None = None,
             measure_cpu: bool = False, busy: bool = True, busy_hz: float = 20.0,
             busy_source: BusySource | None = None, started: float | None = None,
             memory: bool = True, timing: str | None = None,
             on_revision: Callable[[Revision], None] | None = None) -> Telemetry:
        """Detect the device's peaks, write device.json, start the busy sampler.

        `peaks` replaces detection entirely; `peak_flops`/`peak_bytes_per_s` override single roofs
        (the recipe's fields). `busy=False` runs no sampler; `busy_source` replaces the device's
        default (NVML on NVIDIA, process CPU time on a CPU). `started` is the run's start on the
        `time.perf_counter()` clock. `memory=False` records no memory per phase. `timing` None picks
        "events" on CUDA (unless POSTTRAIN_SYNC_PHASES=1) and "sync" elsewhere.
        """
        device = torch.device(device)
        dt = dtype_name(dtype)
        if peaks is None:
            peaks = detect(device, dt, peak_flops=peak_flops, peak_bytes_per_s=peak_bytes_per_s,
                           measure_cpu=measure_cpu)
        run = Path(run_dir) if run_dir is not None else None
        if run is not None:
            run.mkdir(parents=True, exist_ok=True)
        source = (busy_source if busy_source is not None else source_for(device)) if busy else None
        meter = meter_for(device) if memory else None
        tick = meter.sample if isinstance(meter, SampledRss) else None
        sampler = BusySampler(source, hz=busy_hz, on_tick=tick) if source is not None else None
        if timing is None:
            timing = "events" if device.type == "cuda" and os.environ.get(ENV_SYNC_PHASES) != "1" else "sync"
        tele = cls(peaks=peaks, dtype=dt, run_dir=run, sampler=sampler,
                   sync=_synchronizer(device) if timing == "sync" else (lambda: None),
                   started=started, memory=meter, timing=timing, on_revision=on_revision)
        tele.write_device()
        return tele

    @classmethod
    def disabled(cls) -> Telemetry:
        """A Telemetry whose phases cost nothing and record nothing (stages run without a run dir)."""
        return cls(peaks=Peaks(name="none", kind="none"), dtype="fp32", enabled=False)

    def device_json(self) -> dict[str, Any]:
        """device.json: the peaks as revised so far, the revisions, how memory and time are measured."""
        obj = self.peaks.to_json(self.dtype)
        obj["timing"] = self.timing
        obj["memory"] = self.memory.meter.kind if self.memory is not None else None
        if self.revisions:
            obj["revisions"] = [r.to_json() for r in self.revisions]
        return obj

    def write_device(self) -> None:
        if self.run_dir is None or not self.enabled:
            return
        path = self.run_dir / "device.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.device_json(), indent=2) + "\n")
        tmp.replace(path)

    # ---- phases ---------------------------------------------------------------------------------
    def _frames(self) -> list[Phase]:
        frames = getattr(self._stack, "frames", None)
        if frames is None:
            frames = self._stack.frames = []
        return frames

    @contextmanager
    def phase(self, name: str, *, stage: str, step: int, cost: Cost | None = None,
              worker: str = MAIN_WORKER) -> Iterator[Phase]:
        """Time the block as phase `name` of `stage`'s step `step`; `cost` may be set on the handle later.
        `worker`: who runs it (a rollout thread times its phases as e.g. "rollout0"); phases nest only
        within one thread, so a worker thread's phases never become a learner phase's children."""
        handle = Phase(name=name, stage=stage, step=step, cost=cost, worker=worker)
        if not self.enabled:
            yield handle
            return
        if not _NAME.match(name):
            raise ValueError(f"phase name {name!r}: expected lowercase letters, digits and '_' "
                             f"(standard names: {', '.join(STANDARD_PHASES)})")
        frames = self._frames()
        self._sync()  # device sync point ("sync" timing): work queued before the phase is not billed to it
        if self.memory is not None:
            handle._mem_start, handle._mem_peak = self.memory.enter(frames)
        if self.timing == "events":
            handle._events = (self._event(), self._event())
            handle._events[0].record()
        handle._start = time.perf_counter()
        frames.append(handle)
        with self._lock:
            self._open[id(handle)] = handle._start
        try:
            yield handle
        finally:
            self._sync()  # device sync point ("sync" timing): the phase's kernels have finished
            if handle._events is not None:
                handle._events[1].record()
            end = time.perf_counter()
            frames.pop()
            parent = frames[-1] if frames else None
            mem = self.memory.leave(handle, parent) if self.memory is not None else None
            if parent is not None:
                parent._children.append((handle._start, end))
                parent._child_seconds += end - handle._start
                parent._child_handles.append(handle)
            busy = self.sampler.mean(handle._start, end, handle._children) if self.sampler else None
            if handle._events is not None:  # read later, in order (children end before their parents)
                with self._lock:
                    self._deferred.append((handle, end, parent.name if parent is not None else None, busy, mem))
                    many = len(self._deferred) > _MAX_DEFERRED
                if many:
                    self._resolve()
            else:
                self._record(handle, end, end - handle._start - handle._child_seconds,
                             parent.name if parent is not None else None, busy, mem)

    def _resolve(self) -> None:
        """Read the events of finished event-timed phases (waits for the last one) and record them."""
        with self._lock:
            todo, self._deferred = self._deferred, []
        for handle, end, parent, busy, mem in todo:
            start_ev, end_ev = handle._events
            end_ev.synchronize()  # device sync point: only as far as this phase's end
            handle._elapsed = start_ev.elapsed_time(end_ev) / 1e3
            children = sum(c._elapsed or 0.0 for c in handle._child_handles)
            self._record(handle, end, max(0.0, handle._elapsed - children), parent, busy, mem)

    def _record(self, handle: Phase, end: float, seconds: float, parent: str | None, busy: float | None,
                mem: Any) -> None:
        cost = handle.cost or Cost()
        record = PhaseRecord(stage=handle.stage, step=handle.step, name=handle.name,
                             start=handle._start - self.started, seconds=seconds,
                             flops=float(cost.flops), bytes=float(cost.bytes), busy=busy, parent=parent,
                             mem_peak=None if mem is None else mem.peak,
                             mem_start=None if mem is None else mem.start,
                             mem_reserved=None if mem is None else mem.reserved, worker=handle.worker)
        with self._lock:
            self._open.pop(id(handle), None)
        self._add(record, handle._start, end)

    def record_external(self, record: PhaseRecord) -> None:
        """Add a phase timed elsewhere — in a rollout worker's process (a Ray actor) — whose `start` is
        already seconds since this run started (the caller maps the worker's clock). It is written,
        folded into its step's metrics and placed on the roofline like a phase timed here."""
        if not self.enabled:
            return
        self._add(record, self.started + record.start, self.started + record.start + record.seconds)

    def _add(self, record: PhaseRecord, start: float, end: float) -> None:
        key = (record.stage, record.step)
        with self._lock:
            self._pending.setdefault(key, []).append(record)
            lo, hi = self._windows.get(key, (start, end))
            self._windows[key] = (min(lo, start), max(hi, end))
            if self._sink is not None:
                self._sink.log(record.to_json())
            revised = revise_one(self.peaks, self.dtype, record)
            self.revisions += revised
        if revised:
            self.write_device()
            note_observed(self.peaks, self.dtype, revised)
            for r in revised:
                self.on_revision(r)

    def note_consumers(self, stage: str, step: int, consumers: dict[str, int]) -> None:
        """Record the largest known holders of memory at this point (memory.jsonl; `memory.consumers`)."""
        if self.run_dir is None or not self.enabled or not consumers:
            return
        if self._memory_sink is None:
            self._memory_sink = JsonlSink(self.run_dir / "memory.jsonl")
        self._memory_sink.log({"stage": stage, "step": step, "consumers": dict(consumers)})

    def records(self, stage: str, step: int) -> list[PhaseRecord]:
        """The records of a step not yet folded by `step_metrics`."""
        if self._deferred:
            self._resolve()
        with self._lock:
            return list(self._pending.get((stage, step), []))

    # ---- per-step aggregation -------------------------------------------------------------------
    def step_metrics(self, *, stage: str, step: int) -> dict[str, float | str]:
        """Fold the step's phase records into metrics.jsonl keys, and forget them.

        Per phase name: `phase/<name>/seconds` (sum of exclusive time), `…/flops_per_s`,
        `…/bytes_per_s`, `…/intensity`, `…/pct_compute_roof`, `…/pct_bandwidth_roof` (0..100, against
        the roofs as revised: never above 100), `…/bound`, `…/busy` (time-weighted over occurrences),
        `…/mem_peak_bytes` (the largest peak over occurrences); plus `telemetry/busy`, the busy mean
        over the whole step. Keys whose value is undefined (no cost, unknown peak) are left out.

        These keys are the main worker's (the one process, or the learner / rank 0): what the step's wall
        clock is made of. Another worker's phases (a data-parallel rank, a rollout thread or actor) fold
        into the same values under `phase@<worker>/<name>/…` — never summed into the main worker's, where
        a learner's `generate` (the wait for a remote rollout) and the rollout worker's own `generate`
        would count the same decode twice.
        """
        if not self.enabled:
            return {}
        if self._deferred:
            self._resolve()  # the step's one wait on the device (event timing)
        with self._lock:
            records = self._pending.pop((stage, step), [])
            window = self._windows.pop((stage, step), None)
        by_name: dict[tuple[str, str], list[PhaseRecord]] = {}
        for r in records:
            by_name.setdefault((r.worker, r.name), []).append(r)
        peak_flops = self.peaks.flops_for(self.dtype)
        out: dict[str, float | str] = {}
        for (worker, name), group in by_name.items():
            seconds = sum(r.seconds for r in group)
            flops, nbytes = sum(r.flops for r in group), sum(r.bytes for r in group)
            p = place(flops, nbytes, seconds, peak_flops=peak_flops, peak_bytes_per_s=self.peaks.bytes_per_s,
                      overhead_below=self.overhead_below)
            peaks = [r.mem_peak for r in group if r.mem_peak is not None]
            values: dict[str, float | str | None] = {
                "seconds": seconds, "flops_per_s": p.flops_per_s, "bytes_per_s": p.bytes_per_s,
                "intensity": p.intensity, "pct_compute_roof": p.pct_compute_roof,
                "pct_bandwidth_roof": p.pct_bandwidth_roof, "bound": p.bound.value,
                "busy": _time_weighted_busy(group), "mem_peak_bytes": float(max(peaks)) if peaks else None,
            }
            prefix = "phase" if worker == MAIN_WORKER else f"phase@{worker}"
            out.update({f"{prefix}/{name}/{k}": v for k, v in values.items() if v is not None})
        if self.sampler is not None and window is not None:
            busy = self.sampler.mean(*window)
            if busy is not None:
                out["telemetry/busy"] = busy
            with self._lock:  # keep samples any unfinished phase or unfolded step may still need
                keep_from = [w[0] for w in self._windows.values()] + list(self._open.values())
            self.sampler.prune(min(keep_from + [window[1]]))
        return out

    def close(self) -> None:
        if self._deferred:
            self._resolve()
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        for sink in (self._sink, self._memory_sink):
            if sink is not None:
                sink.close()


def _time_weighted_busy(records: list[PhaseRecord]) -> float | None:
    timed = [(r.seconds, r.busy) for r in records if r.busy is not None]
    total = sum(s for s, _ in timed)
    if not timed:
        return None
    if total <= 0:
        return sum(b for _, b in timed) / len(timed)
    return sum(s * b for s, b in timed) / total
