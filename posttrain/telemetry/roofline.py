"""Roofline placement of a measured phase and its verdict: compute-, memory- or overhead-bound.

Source: Williams, Waterman & Patterson 2009, "Roofline: an insightful visual performance model for
multicore architectures" (CACM 52(4)). Attainable performance at arithmetic intensity I (FLOP/byte)
is min(P, B·I) for peak compute P (FLOP/s) and peak memory bandwidth B (bytes/s); the ridge point
I* = P / B separates the memory-bound slope (I < I*) from the compute-bound flat (I ≥ I*).

The verdict (documented in docs/telemetry.md, tested at and around the ridge):
    efficiency = achieved FLOP/s / min(P, B·I)                  (fraction of the roof this intensity allows)
    efficiency < OVERHEAD_BELOW (0.25)  → "overhead"  (far under the roof: launch, Python, sync, latency)
    else I ≥ I*                          → "compute"
    else                                 → "memory"
    peaks unknown, or no cost given      → "unknown"

Departures:
1. A phase with bytes but no FLOPs (e.g. `sync`: copying weights) is placed on the bandwidth roof
   alone: efficiency = achieved bytes/s / B. One with FLOPs but no bytes is placed on the compute roof.
2. The 0.25 threshold is a judgement, not physics: a tuned kernel sustains 60–90% of a roof, so a
   phase under a quarter of what its intensity allows is losing most of its time to something the
   roofline does not model. It is a parameter of `place` so a caller can tighten it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

OVERHEAD_BELOW = 0.25


class Bound(str, Enum):  # str-valued (StrEnum is 3.11+; the project supports 3.10)
    COMPUTE = "compute"
    MEMORY = "memory"
    OVERHEAD = "overhead"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Placement:
    """Where a phase sits on the roofline. Percentages are 0..100; None where not defined."""

    flops_per_s: float | None
    bytes_per_s: float | None
    intensity: float | None            # FLOP/byte; None without bytes
    attainable_flops_per_s: float | None
    pct_compute_roof: float | None     # achieved FLOP/s ÷ peak FLOP/s × 100
    pct_bandwidth_roof: float | None   # achieved bytes/s ÷ peak bytes/s × 100
    efficiency: float | None           # fraction of the roof at this intensity (0..1, can exceed 1 on bad peaks)
    bound: Bound


def ridge_point(peak_flops: float, peak_bytes_per_s: float) -> float:
    """I* = P / B in FLOP/byte: the intensity above which the compute roof binds."""
    return peak_flops / peak_bytes_per_s


def place(flops: float, bytes_moved: float, seconds: float, *, peak_flops: float | None,
          peak_bytes_per_s: float | None, overhead_below: float = OVERHEAD_BELOW) -> Placement:
    """Place `flops` FLOPs and `bytes_moved` bytes done in `seconds` on the device roofline."""
    if seconds < 0 or flops < 0 or bytes_moved < 0:
        raise ValueError(f"place: flops={flops}, bytes={bytes_moved}, seconds={seconds}; expected all ≥ 0")
    if seconds == 0 or (flops == 0 and bytes_moved == 0):
        return Placement(None, None, None, None, None, None, None, Bound.UNKNOWN)
    fps = flops / seconds if flops > 0 else None
    bps = bytes_moved / seconds if bytes_moved > 0 else None
    intensity = flops / bytes_moved if bytes_moved > 0 else None
    pct_c = 100.0 * fps / peak_flops if fps is not None and peak_flops else None
    pct_b = 100.0 * bps / peak_bytes_per_s if bps is not None and peak_bytes_per_s else None

    if fps is not None and bps is not None:
        if not (peak_flops and peak_bytes_per_s):
            return Placement(fps, bps, intensity, None, pct_c, pct_b, None, Bound.UNKNOWN)
        assert intensity is not None
        attainable = min(peak_flops, peak_bytes_per_s * intensity)
        efficiency = fps / attainable
        side = Bound.COMPUTE if intensity >= ridge_point(peak_flops, peak_bytes_per_s) else Bound.MEMORY
    elif fps is not None:  # FLOPs, no bytes counted: compute roof only
        if not peak_flops:
            return Placement(fps, None, None, None, None, None, None, Bound.UNKNOWN)
        attainable, efficiency, side = peak_flops, fps / peak_flops, Bound.COMPUTE
    else:  # bytes only: bandwidth roof only
        assert bps is not None
        if not peak_bytes_per_s:
            return Placement(None, bps, None, None, None, None, None, Bound.UNKNOWN)
        attainable, efficiency, side = None, bps / peak_bytes_per_s, Bound.MEMORY
    bound = Bound.OVERHEAD if efficiency < overhead_below else side
    return Placement(fps, bps, intensity, attainable, pct_c, pct_b, efficiency, bound)
