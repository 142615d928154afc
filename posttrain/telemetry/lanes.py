"""Lanes: one timeline per worker — who ran what when, and who sat idle.

A phase record carries its `worker` ("main": the one process or the learner; "rank1"…: the other
data-parallel ranks; "rollout0"…: rollout workers, threads or Ray actors) and its real `start`
(seconds since the run started, one clock for every worker — `Telemetry.record_external` maps a
remote worker's clock onto it). Laid out by real start time, the records of a window [a, b) give
each worker a lane of busy spans with idle gaps between them, and

    busy_w     = |⋃ spans of w ∩ [a, b)|       seconds worker w ran a phase in the window
    fraction_w = busy_w / (b − a)              its busy fraction of the window

the seed's picture: in synchronous RL the rollout worker idles while the learner updates and the
learner idles while it waits for rollouts (fractions that sum to about 1 over two workers); run
asynchronously they overlap (fractions that sum to more).

The window of one RL cycle, step s of a stage (`step_window`): from a_s, the earliest start of any
worker's record tagged s, to a_{s+1} (the next step's), or, for the stage's last step, to the latest
end of a record tagged s. Records are clipped to the window by time, not chosen by their step tag:
in an asynchronous run the rollout of step s+1 runs during step s's update, and that overlap is the
point of the picture.

Departures:
1. A record's `seconds` is exclusive (docs/telemetry.md): a lane's span for a top-level phase is its
   inclusive time, rebuilt as its own seconds plus those of the nested records that start inside it
   on the same worker (phases nest only within one thread, so a worker's records are sequential
   apart from nesting). Nested phases are not drawn separately: a lane shows what the worker was
   busy with at the top level.
2. With CUDA event timing a phase's seconds are GPU time while `start` is host time, so a span can be
   a little shorter than the host interval it sits in; gaps then include host time that queued no work.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.telemetry.phases import MAIN_WORKER, PhaseRecord

IDLE = "idle"


@dataclass(frozen=True)
class Span:
    """A piece of a lane: a phase (by its top-level name) or `idle`, [x0, x1) in seconds since the run started."""

    name: str
    x0: float
    x1: float
    step: int | None = None  # the step the phase was recorded for (None: idle)

    @property
    def seconds(self) -> float:
        return self.x1 - self.x0


@dataclass(frozen=True)
class Lane:
    """One worker's window: busy and idle spans in time order, covering [window start, window end)."""

    worker: str
    spans: list[Span]
    busy: float      # seconds in a phase
    fraction: float  # busy / window length, 0..1

    def seconds_by_phase(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.spans:
            if s.name != IDLE:
                out[s.name] = out.get(s.name, 0.0) + s.seconds
        return out


@dataclass(frozen=True)
class Lanes:
    """Every worker's lane over one window [start, end) (seconds since the run started)."""

    start: float
    end: float
    lanes: list[Lane]  # main first, then ranks, then rollout workers, then any other (numbers in order)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def lane(self, worker: str) -> Lane | None:
        return next((lane for lane in self.lanes if lane.worker == worker), None)


def worker_order(worker: str) -> tuple[int, str, int]:
    """Sort key: main, rank1, rank2 …, rollout0, rollout1 …, then anything else by name and number."""
    m = re.match(r"^(.*?)(\d+)$", worker)
    base, num = (m.group(1), int(m.group(2))) if m else (worker, -1)
    group = 0 if worker == MAIN_WORKER else 1 if base == "rank" else 2 if base == "rollout" else 3
    return group, base, num


def top_level_spans(records: Sequence[PhaseRecord]) -> dict[str, list[Span]]:
    """Per worker, its top-level phases as [start, start + inclusive seconds) (departure 1), by start."""
    by_worker: dict[str, list[PhaseRecord]] = {}
    for r in records:
        by_worker.setdefault(r.worker, []).append(r)
    out: dict[str, list[Span]] = {}
    for worker, recs in by_worker.items():
        recs.sort(key=lambda r: (r.start, r.parent is not None))
        tops: list[list] = []  # [name, start, inclusive seconds, step]
        for r in recs:
            if r.parent is None or not tops:
                tops.append([r.name, r.start, r.seconds, r.step])
            else:
                tops[-1][2] += r.seconds  # a nested record belongs to the top-level phase it starts in
        out[worker] = [Span(name, x0, x0 + secs, step) for name, x0, secs, step in tops]
    return out


def lanes(records: Sequence[PhaseRecord], start: float, end: float, *,
          workers: Sequence[str] = ()) -> Lanes:
    """Every worker's lane over [start, end): spans clipped to the window, gaps filled with `idle`.

    `workers`: lanes to include even when idle throughout (e.g. every worker the stage has, for a
    window in which one ran nothing). Overlapping spans of one worker (which sequential phases should
    not produce) are merged into the first, so busy time is never counted twice."""
    if end < start:
        raise ValueError(f"lanes: window [{start}, {end}) ends before it starts")
    spans = top_level_spans(records)
    names = sorted(set(spans) | set(workers), key=worker_order)
    length = end - start
    out = []
    for w in names:
        drawn: list[Span] = []
        t, busy = start, 0.0
        for s in spans.get(w, []):
            x0, x1 = max(s.x0, t), min(s.x1, end)
            if x1 <= x0:
                continue  # outside the window, or wholly under an earlier span
            if x0 > t:
                drawn.append(Span(IDLE, t, x0))
            drawn.append(Span(s.name, x0, x1, s.step))
            busy += x1 - x0
            t = x1
        if t < end:
            drawn.append(Span(IDLE, t, end))
        out.append(Lane(w, drawn, busy, busy / length if length > 0 else 0.0))
    return Lanes(start, end, out)


def step_window(records: Sequence[PhaseRecord], step: int) -> tuple[float, float]:
    """The window of `step` (module docstring): its first start to the next step's first start, or to
    its own last end when no later step was recorded. `records`: one stage's."""
    tagged = [r for r in records if r.step == step]
    if not tagged:
        raise ValueError(f"lanes: no phase record for step {step}")
    a = min(r.start for r in tagged)
    later = [r.step for r in records if r.step > step]
    if later:
        nxt = min(later)
        return a, max(a, min(r.start for r in records if r.step == nxt))
    return a, max(s.x1 for spans in top_level_spans(tagged).values() for s in spans)


def step_lanes(records: Sequence[PhaseRecord], step: int) -> Lanes:
    """The lanes of one RL cycle: step `step`'s window, every worker of `records` given a lane."""
    a, b = step_window(records, step)
    return lanes(records, a, b, workers=sorted({r.worker for r in records}))


def stage_lanes(records: Sequence[PhaseRecord]) -> Lanes | None:
    """The lanes over a stage's whole span (first start → last end): each worker's cycle average."""
    if not records:
        return None
    tops = top_level_spans(records)
    start = min(s.x0 for spans in tops.values() for s in spans)
    end = max(s.x1 for spans in tops.values() for s in spans)
    return lanes(records, start, end)
