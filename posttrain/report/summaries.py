"""What the report says about each stage, computed only from what the run recorded.

Per stage: wall time, the per-phase roofline table (pooled over the stage's steps with
`posttrain.telemetry.gap`), peak memory, and its measured *character*:

    character rule (phases named `eval` are measurement, not training: left out of the character and
    reported beside it as the eval share of the stage's phase time):
    1. the tag is the training phases the stage actually ran, in loop order (generate, score,
       reference, update, sync, then any other): "generate + score + reference + update + sync" for
       PPO/GRPO, "reference + update" for DPO with a reference model, "update" for SFT or SimPO;
    2. a stage that ran `generate` and `update` is an RL stage (kind "rl"); any other takes the verdict
       of its longest phase with a verdict (compute / memory / overhead), appended to the tag:
       "reference + update · compute-bound";
    3. the detail names the verdict and time share (of the training phases' time) of the longest
       phases; no phase with a verdict and no training phase → "unmeasured".

For an RL stage (one that ran `generate` and `update`), one iteration: the representative cycle (the
(stage, step) whose phase time is the median among steps holding generate and update and no eval) laid out in time, and the
phase rates pooled over all the stage's non-eval phases — the input of the rollout:update projection
(`posttrain.telemetry.gap`), which the page recomputes in JavaScript from those same numbers.

Departures:
1. The timeline lays the cycle's phases end to end in start order, each as long as its *exclusive*
   time, so the axis sums to the cycle's phase time T of the gap; a nested phase therefore appears
   after its parent rather than inside it.
2. The projection pools every step of the stage (not the one drawn) so a single noisy step does not
   set the slider's numbers; the page says how many steps it pooled.
3. Beside that end-to-end view, the same step by real start time, one lane per worker
   (`posttrain.telemetry.lanes`): idle gaps drawn, each worker's busy fraction of the step's window
   and of the whole stage. A one-process run has one lane, `main`, whose gaps are host time between
   phases.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.report.run_data import BASE, RunData, StageInfo
from posttrain.telemetry.gap import DEFAULT_RATIOS, UPDATE_PHASES, Gap, gap
from posttrain.telemetry.lanes import Lanes, stage_lanes, step_lanes
from posttrain.telemetry.phases import PhaseRecord
from posttrain.telemetry.roofline import place

EVAL_PHASES = ("eval",)
LOOP_ORDER = ("generate", "tool", "score", "reference", "update", "sync")  # the order a character names phases in


@dataclass(frozen=True)
class PhaseRow:
    """One phase of one stage, pooled over its occurrences, placed on the roofline."""

    name: str
    occurrences: int
    seconds: float
    share: float                      # 0..1 of the stage's phase time
    flops: float
    bytes: float
    flops_per_s: float | None
    bytes_per_s: float | None
    intensity: float | None           # FLOP/byte
    pct_compute_roof: float | None    # 0..100
    pct_bandwidth_roof: float | None  # 0..100
    efficiency: float | None          # 0..1 of the roof its intensity allows
    bound: str
    busy: float | None                # 0..1
    mem_peak: int | None = None       # bytes: the largest peak over its occurrences


@dataclass(frozen=True)
class Character:
    tag: str      # the training phases run, e.g. "generate + score + reference + update + sync" or "update · compute-bound"
    kind: str     # compute | memory | overhead | rl | unknown — the page's colour
    detail: str   # one line of evidence


@dataclass(frozen=True)
class StageSummary:
    info: StageInfo
    steps_seen: int                   # highest step in its records
    wall_seconds: float | None        # first phase start → last phase end (else from metrics times)
    phase_seconds: float              # Σ exclusive phase time
    phases: list[PhaseRow]            # most time first
    gap: Gap | None
    character: Character
    eval_share: float = 0.0           # 0..1 of the stage's phase time spent in `eval`
    mem_peak: int | None = None       # bytes: the stage's largest phase peak
    consumers: dict[str, int] | None = None  # the largest known holders of memory (memory.jsonl), bytes


def phase_rows(records: Sequence[PhaseRecord], *, peak_flops: float | None,
               peak_bytes_per_s: float | None) -> tuple[list[PhaseRow], Gap | None]:
    if not records:
        return [], None
    g = gap(records, peak_flops=peak_flops, peak_bytes_per_s=peak_bytes_per_s)
    counts: dict[str, int] = {}
    mem: dict[str, int] = {}
    for r in records:
        counts[r.name] = counts.get(r.name, 0) + 1
        if r.mem_peak is not None:
            mem[r.name] = max(mem.get(r.name, 0), r.mem_peak)
    rows = []
    for s in g.phases:
        p = place(s.flops, s.bytes, s.seconds, peak_flops=peak_flops, peak_bytes_per_s=peak_bytes_per_s)
        rows.append(PhaseRow(name=s.name, occurrences=counts[s.name], seconds=s.seconds, share=s.share,
                             flops=s.flops, bytes=s.bytes, flops_per_s=p.flops_per_s, bytes_per_s=p.bytes_per_s,
                             intensity=p.intensity, pct_compute_roof=p.pct_compute_roof,
                             pct_bandwidth_roof=p.pct_bandwidth_roof, efficiency=p.efficiency,
                             bound=p.bound.value, busy=s.busy, mem_peak=mem.get(s.name)))
    return rows, g


def _bound_tag(bound: str) -> str:
    return f"{bound}-bound"


def training_phases(rows: Sequence[PhaseRow]) -> list[str]:
    """The phase names a stage ran outside `eval`, in loop order (then any other, longest first)."""
    names = {r.name for r in rows if r.name not in EVAL_PHASES}
    others = [r.name for r in sorted(rows, key=lambda r: -r.seconds) if r.name in names and r.name not in LOOP_ORDER]
    return [n for n in LOOP_ORDER if n in names] + others


def is_rl(names: Sequence[str] | set[str]) -> bool:
    """A stage is RL when it generated its own training data and learned from it in the same loop."""
    return "generate" in names and bool(set(names) & set(UPDATE_PHASES))


def character(rows: Sequence[PhaseRow]) -> Character:
    """The measured character of a stage from its pooled phase rows (rule in the module docstring)."""
    names = training_phases(rows)
    work = [r for r in rows if r.name in names]
    measured = sorted((r for r in work if r.bound != "unknown"), key=lambda r: -r.seconds)
    if not measured:
        tag = f"{' + '.join(names)} · unmeasured" if names else "unmeasured"
        return Character(tag, "unknown", "no phase with a declared cost and a known peak")
    total = sum(r.seconds for r in work)

    def say(r: PhaseRow) -> str:
        return f"{r.name} {_bound_tag(r.bound)} ({100 * r.seconds / total:.0f}% of the training time)"

    detail = " · ".join(say(r) for r in measured[:2])
    if is_rl(names):
        return Character(" + ".join(names), "rl", detail)
    top = measured[0]
    return Character(f"{' + '.join(names)} · {_bound_tag(top.bound)}", top.bound, detail)


def summarize_stage(run: RunData, info: StageInfo) -> StageSummary:
    records = run.stage_phases(info.name)
    rows, g = phase_rows(records, peak_flops=run.peak_flops, peak_bytes_per_s=run.peak_bytes_per_s)
    metrics = run.stage_metrics(info.name)
    steps = [r.step for r in records] + [int(m["step"]) for m in metrics if isinstance(m.get("step"), int)]
    if records:
        wall: float | None = max(r.start + r.seconds for r in records) - min(r.start for r in records)
    else:
        times = [m["time"] for m in metrics if isinstance(m.get("time"), (int, float))]
        wall = max(times) - min(times) if len(times) > 1 else None
    phase_seconds = sum(r.seconds for r in records)
    eval_seconds = sum(r.seconds for r in records if r.name in EVAL_PHASES)
    consumers = None
    for m in run.memory:
        if m.get("stage") == info.name and isinstance(m.get("consumers"), dict):
            consumers = {str(k): int(v) for k, v in m["consumers"].items()}  # the last record counts
    peaks = [r.mem_peak for r in rows if r.mem_peak is not None]
    return StageSummary(info=info, steps_seen=max(steps, default=0), wall_seconds=wall,
                        phase_seconds=phase_seconds, phases=rows, gap=g, character=character(rows),
                        eval_share=eval_seconds / phase_seconds if phase_seconds > 0 else 0.0,
                        mem_peak=max(peaks) if peaks else None, consumers=consumers)


def summarize(run: RunData) -> list[StageSummary]:
    """One summary per stage that left any record, in pipeline order."""
    seen = {m.get("stage") for m in run.metrics} | {p.stage for p in run.phases} | {e.get("stage") for e in run.evals}
    return [summarize_stage(run, s) for s in run.stages if s.name in seen and s.name != BASE]


# ---- one RL iteration ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Segment:
    """One phase of the drawn cycle: [x0, x1) on the cycle's time axis (seconds)."""

    name: str
    x0: float
    x1: float
    busy: float | None          # 0..1
    efficiency: float | None    # 0..1 of the roof its intensity allows
    utilization: float | None   # 0..1 of the compute roof
    bound: str
    mem_peak: int | None = None  # bytes


@dataclass(frozen=True)
class RLIteration:
    stage: str
    step: int                   # the representative cycle
    segments: list[Segment]
    cycle: Gap                  # gap of the drawn cycle (its averages)
    pooled: Gap                 # gap over the stage's non-eval phases: the projection's input
    pooled_steps: int
    # the same step by real start time, one lane per worker (learner, ranks, rollout workers) with its
    # idle gaps, over the step's window (posttrain.telemetry.lanes); and each worker's stage average
    lanes: Lanes | None = None
    stage_lanes: Lanes | None = None


def _is_rl(records: Sequence[PhaseRecord]) -> bool:
    return is_rl({r.name for r in records})


def rl_iteration(run: RunData, stage: str, *, ratios: Sequence[float] = DEFAULT_RATIOS) -> RLIteration | None:
    """The iteration view of `stage`, or None when it has no cycle with both generate and update phases
    (a DPO step — reference + update — is not an RL iteration: it generates nothing)."""
    work = [r for r in run.stage_phases(stage) if r.name not in EVAL_PHASES]
    by_step: dict[int, list[PhaseRecord]] = {}
    for r in run.stage_phases(stage):
        by_step.setdefault(r.step, []).append(r)
    cycles = {s: recs for s, recs in by_step.items()
              if _is_rl(recs) and not any(r.name in EVAL_PHASES for r in recs)}
    if not cycles:
        return None
    totals = sorted((sum(r.seconds for r in recs), s) for s, recs in cycles.items())
    median = statistics.median_low(t for t, _ in totals)
    step = next(s for t, s in totals if t == median)
    recs = sorted(cycles[step], key=lambda r: r.start)
    pf, pb = run.peak_flops, run.peak_bytes_per_s
    segments, x = [], 0.0
    for r in recs:
        p = place(r.flops, r.bytes, r.seconds, peak_flops=pf, peak_bytes_per_s=pb)
        u = r.flops / (r.seconds * pf) if pf and r.seconds > 0 else None
        segments.append(Segment(r.name, x, x + r.seconds, r.busy, p.efficiency, u, p.bound.value, r.mem_peak))
        x += r.seconds
    return RLIteration(stage=stage, step=step, segments=segments,
                       cycle=gap(recs, peak_flops=pf, peak_bytes_per_s=pb, ratios=ratios),
                       pooled=gap(work, peak_flops=pf, peak_bytes_per_s=pb, ratios=ratios),
                       pooled_steps=len({r.step for r in work}),
                       lanes=step_lanes(work, step), stage_lanes=stage_lanes(work))


def rl_iterations(run: RunData) -> list[RLIteration]:
    out = []
    for s in run.stages:
        it = rl_iteration(run, s.name)
        if it is not None:
            out.append(it)
    return out


# ---- evals across the pipeline ---------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalCell:
    value: float | None
    stderr: float | None
    n: int | None


@dataclass(frozen=True)
class EvalTable:
    """The bisect table: one row per (eval, level, metric), one column per checkpoint in pipeline order."""

    columns: list[str]
    rows: list[tuple[str, str | None, str]]
    cells: dict[tuple[str, tuple[str, str | None, str]], EvalCell]

    def cell(self, column: str, row: tuple[str, str | None, str]) -> EvalCell | None:
        return self.cells.get((column, row))


def eval_table(run: RunData) -> EvalTable:
    order = [BASE] + [s.name for s in run.stages]
    present = {e.get("stage") for e in run.evals}
    columns = [s for s in order if s in present]
    rows: list[tuple[str, str | None, str]] = []
    cells = {}
    for i, e in enumerate(run.evals):
        try:
            key = (str(e["eval"]), e.get("level"), str(e["metric"]))
            cell = EvalCell(value=e["value"], stderr=e.get("stderr"), n=e.get("n"))
            stage = str(e["stage"])
        except KeyError as missing:
            raise ValueError(f"evals.jsonl record {i + 1}: missing {missing}; expected stage, eval, metric, value "
                             "(docs/run_dir.md)") from None
        if key not in rows:
            rows.append(key)
        cells[(stage, key)] = cell  # a re-run eval of the same checkpoint: the last one counts
    return EvalTable(columns=columns, rows=rows, cells=cells)
