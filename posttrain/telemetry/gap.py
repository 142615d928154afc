"""The gap: what one RL cycle really uses of the device, beside what the busy line says.

A pure function over phase records (phases.jsonl) and the device's peaks; the run report calls it too.

For a set of records (one cycle = one (stage, step), or many cycles pooled), with phase p taking
exclusive time t_p and doing F_p FLOPs and Y_p bytes:

    T          = Σ_p t_p                                         cycle time
    share_p    = t_p / T                                         time share
    u_p        = F_p / (t_p · P)                                 phase's fraction of the compute roof P
    e_p        = efficiency of p on the roofline (roofline.place: achieved ÷ min(P, B·I_p))
    U          = Σ_p share_p · u_p  = ΣF_p / (T · P)             time-weighted achieved utilization (MFU)
    E          = Σ_p share_p · e_p                               time-weighted fraction of each phase's roof
    busy       = Σ_{p: b_p known} t_p · b_p / Σ_{p: b_p known} t_p   the dashboard's average

Projection to a rollout:update time ratio r (the phase *rates* u_p, e_p, b_p held at their measured
values): rollout phases R = {generate, tool, score, reference}, update phases = {update}, the rest
(sync, eval, …) kept at their measured seconds. With R₀ = Σ_{p∈R} t_p and U₀ = Σ_{update} t_p,
each rollout phase is scaled by k = r · U₀ / R₀ (so rollout time = r × update time):

    t'_p = k · t_p  (p ∈ R),   t'_p = t_p  otherwise
    U(r) = Σ_p t'_p · u_p / Σ_p t'_p,   busy(r) likewise (over phases with a busy value)

At r = R₀/U₀ (the measured ratio) U(r) = U. No projection when a cycle has no `generate` or no
update: a DPO step's reference forward is not a rollout (nothing is generated), so a reference +
update cycle has no rollout:update ratio to move.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from posttrain.telemetry.phases import PhaseRecord
from posttrain.telemetry.roofline import place

ROLLOUT_PHASES = ("generate", "tool", "score", "reference")
UPDATE_PHASES = ("update",)
DEFAULT_RATIOS: tuple[float, ...] = (1, 2, 3, 5, 10, 20)


@dataclass(frozen=True)
class PhaseShare:
    name: str
    seconds: float
    share: float                     # 0..1 of the cycle's time
    flops: float
    bytes: float
    utilization: float | None        # u_p: fraction of the compute roof (0..1), None without a peak
    efficiency: float | None         # e_p: fraction of the roof at its intensity (0..1)
    bound: str
    busy: float | None


@dataclass(frozen=True)
class Projection:
    ratio: float                     # rollout seconds : update seconds
    utilization: float | None        # U(r)
    busy: float | None               # busy(r)


@dataclass(frozen=True)
class Gap:
    seconds: float                   # T
    cycles: int                      # number of (stage, step) cycles pooled
    phases: list[PhaseShare]
    utilization: float | None        # U, time-weighted fraction of the compute roof
    efficiency: float | None         # E, time-weighted fraction of each phase's own roof
    busy: float | None               # time-weighted busy average
    rollout_update_ratio: float | None
    projections: list[Projection]


def _weighted(pairs: Iterable[tuple[float, float | None]]) -> float | None:
    known = [(t, v) for t, v in pairs if v is not None]
    total = sum(t for t, _ in known)
    return sum(t * v for t, v in known) / total if known and total > 0 else None


def gap(records: Sequence[PhaseRecord], *, peak_flops: float | None, peak_bytes_per_s: float | None,
        ratios: Sequence[float] = DEFAULT_RATIOS) -> Gap:
    """The gap over `records` (one cycle, or several pooled: phases are summed by name)."""
    by_name: dict[str, list[PhaseRecord]] = {}
    for r in records:
        by_name.setdefault(r.name, []).append(r)
    total = sum(r.seconds for r in records)
    phases = []
    for name, group in by_name.items():
        t = sum(r.seconds for r in group)
        f, y = sum(r.flops for r in group), sum(r.bytes for r in group)
        p = place(f, y, t, peak_flops=peak_flops, peak_bytes_per_s=peak_bytes_per_s)
        u = f / (t * peak_flops) if peak_flops and t > 0 else None
        phases.append(PhaseShare(name=name, seconds=t, share=t / total if total > 0 else 0.0, flops=f, bytes=y,
                                 utilization=u, efficiency=p.efficiency, bound=p.bound.value,
                                 busy=_weighted((r.seconds, r.busy) for r in group)))
    phases.sort(key=lambda s: -s.seconds)
    utilization = _weighted((s.seconds, s.utilization) for s in phases) if peak_flops else None
    generates = any(s.name == "generate" for s in phases)
    rollout = sum(s.seconds for s in phases if s.name in ROLLOUT_PHASES) if generates else 0.0
    update = sum(s.seconds for s in phases if s.name in UPDATE_PHASES)
    projections = []
    if rollout > 0 and update > 0:
        for r in ratios:
            k = r * update / rollout
            scaled = [(s.seconds * (k if s.name in ROLLOUT_PHASES else 1.0), s) for s in phases]
            projections.append(Projection(
                ratio=float(r),
                utilization=_weighted((t, s.utilization) for t, s in scaled) if peak_flops else None,
                busy=_weighted((t, s.busy) for t, s in scaled)))
    return Gap(seconds=total, cycles=len({(r.stage, r.step) for r in records}), phases=phases,
               utilization=utilization, efficiency=_weighted((s.seconds, s.efficiency) for s in phases),
               busy=_weighted((s.seconds, s.busy) for s in phases),
               rollout_update_ratio=rollout / update if rollout > 0 and update > 0 else None,
               projections=projections)


def gaps_by_stage(records: Sequence[PhaseRecord], *, peak_flops: float | None,
                  peak_bytes_per_s: float | None, ratios: Sequence[float] = DEFAULT_RATIOS) -> dict[str, Gap]:
    """One pooled gap per stage, in the order stages first appear."""
    stages: dict[str, list[PhaseRecord]] = {}
    for r in records:
        stages.setdefault(r.stage, []).append(r)
    return {stage: gap(group, peak_flops=peak_flops, peak_bytes_per_s=peak_bytes_per_s, ratios=ratios)
            for stage, group in stages.items()}


def gaps_by_cycle(records: Sequence[PhaseRecord], *, peak_flops: float | None,
                  peak_bytes_per_s: float | None, ratios: Sequence[float] = DEFAULT_RATIOS
                  ) -> dict[tuple[str, int], Gap]:
    """One gap per (stage, step) cycle."""
    cycles: dict[tuple[str, int], list[PhaseRecord]] = {}
    for r in records:
        cycles.setdefault((r.stage, r.step), []).append(r)
    return {key: gap(group, peak_flops=peak_flops, peak_bytes_per_s=peak_bytes_per_s, ratios=ratios)
            for key, group in cycles.items()}
