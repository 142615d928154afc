"""Roofs that are never exceeded: a phase's achieved rate above its roof means the roof is wrong.

A roof is a maximum. When a phase achieves more FLOP/s than the compute roof (or more bytes/s than
the bandwidth roof), either the roof was measured low — a CPU measured while other work shared its
cores reads half its idle rate — or the phase declared more work than it did. Either way a figure over
100% is not a measurement of anything, so the roof is lifted to the best rate observed and the lift
is recorded as a `Revision`, which device.json keeps, and which the CLI, the run summary and the
report state beside the numbers. Nothing is clipped silently: every percentage is against the revised
roof, and the page says which phase revised it, from what to what.

`revise` is pure: peaks + records in, revised peaks + the revisions out. The run applies it record by
record as phases end (`Telemetry`), so metrics.jsonl is written against the roof as revised so far;
the CLI and the report apply it again over the whole phases.jsonl (an older run, or a run killed
before it wrote device.json again, is still never shown above 100%).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from posttrain.telemetry.devices import Peaks


class PhaseRecord(Protocol):
    """What a revision reads of a phase occurrence (`phases.PhaseRecord` has it; declared here so this
    module stays below `phases`, which applies it)."""

    name: str
    stage: str
    step: int
    seconds: float
    flops: float
    bytes: float

# A rate within this factor of the roof is noise, not a revision (perf_counter resolution, a timer tick).
TOLERANCE = 1.0 + 1e-9


@dataclass(frozen=True)
class Revision:
    """One roof lifted to an observed rate."""

    roof: str             # "compute" (at `dtype`) | "bandwidth"
    dtype: str | None     # the compute roof's dtype; None for bandwidth
    old: float            # FLOP/s or bytes/s before
    new: float            # the observed rate it was lifted to
    stage: str            # the phase that achieved it
    step: int
    phase: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Revision:
        return cls(roof=str(obj["roof"]), dtype=obj.get("dtype"), old=float(obj["old"]), new=float(obj["new"]),
                   stage=str(obj["stage"]), step=int(obj["step"]), phase=str(obj["phase"]))

    def sentence(self) -> str:
        unit, scale = ("GFLOP/s", 1e9) if self.roof == "compute" else ("GB/s", 1e9)
        what = f"{self.dtype} compute roof" if self.roof == "compute" else "bandwidth roof"
        return (f"{what} revised from {self.old / scale:,.3g} to {self.new / scale:,.3g} {unit}: "
                f"{self.stage}·{self.phase} step {self.step} achieved {self.new / self.old:.0%} of the old roof")


def revise_one(peaks: Peaks, dtype: str, record: PhaseRecord) -> list[Revision]:
    """Lift `peaks` in place where `record`'s rates exceed them; the revisions made (usually none)."""
    out: list[Revision] = []
    if record.seconds <= 0:
        return out
    peak_flops = peaks.flops.get(dtype)
    if record.flops > 0 and peak_flops:
        rate = record.flops / record.seconds
        if rate > peak_flops * TOLERANCE:
            out.append(Revision("compute", dtype, peak_flops, rate, record.stage, record.step, record.name))
            peaks.flops[dtype] = rate
    if record.bytes > 0 and peaks.bytes_per_s:
        rate = record.bytes / record.seconds
        if rate > peaks.bytes_per_s * TOLERANCE:
            out.append(Revision("bandwidth", None, peaks.bytes_per_s, rate, record.stage, record.step, record.name))
            peaks.bytes_per_s = rate
    return out


def revise(peaks: Peaks, dtype: str, records: Iterable[PhaseRecord]) -> tuple[Peaks, list[Revision]]:
    """A copy of `peaks` lifted to every rate `records` achieved above it, and the lifts, in order.

    Only the run dtype's compute roof and the bandwidth roof are revised (the others were not exercised)."""
    out = copy.deepcopy(peaks)
    revisions: list[Revision] = []
    for r in records:
        revisions += revise_one(out, dtype, r)
    return out, revisions


def net(revisions: Iterable[Revision]) -> list[Revision]:
    """One revision per roof: from the first `old` to the last `new`, attributed to the phase that set it."""
    first: dict[tuple[str, str | None], Revision] = {}
    last: dict[tuple[str, str | None], Revision] = {}
    for r in revisions:
        key = (r.roof, r.dtype)
        first.setdefault(key, r)
        last[key] = r
    return [Revision(k[0], k[1], first[k].old, last[k].new, last[k].stage, last[k].step, last[k].phase) for k in last]


def recorded(device: dict[str, Any] | None) -> list[Revision]:
    """The revisions device.json holds (`revisions`), [] when none."""
    return [Revision.from_json(r) for r in (device or {}).get("revisions") or []]


class Announcer:
    """Says a roof's first revision, then only a rise of `factor` over the last one said: early steps
    lift a low roof a little at a time, and one line per lift would drown the run's output. The final
    figures are in device.json, `posttrain phases` and the report either way."""

    def __init__(self, say: Callable[[str], None], factor: float = 1.25) -> None:
        self.say, self.factor = say, factor
        self._said: dict[tuple[str, str | None], float] = {}

    def __call__(self, r: Revision) -> None:
        key = (r.roof, r.dtype)
        last = self._said.get(key)
        if last is None or r.new >= last * self.factor:
            self._said[key] = r.new
            self.say(f"roof revised: {r.sentence()}")
