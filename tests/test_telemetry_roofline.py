"""Roofline placement and the verdict rule, on synthetic numbers at and around the ridge point."""

from __future__ import annotations

import pytest

from posttrain.telemetry.roofline import OVERHEAD_BELOW, Bound, place, ridge_point

# A device with P = 100 GFLOP/s and B = 10 GB/s: ridge I* = 10 FLOP/byte.
P, B = 100e9, 10e9


def test_ridge_point():
    assert ridge_point(P, B) == 10.0  # 100e9 / 10e9


def _at(intensity: float, efficiency: float):
    """A 1-second phase at `intensity` achieving `efficiency` of min(P, B·I)."""
    attainable = min(P, B * intensity)
    flops = efficiency * attainable
    return place(flops, flops / intensity, 1.0, peak_flops=P, peak_bytes_per_s=B)


def test_at_the_ridge_is_compute_bound():
    p = _at(10.0, 0.8)
    # I = 10 = I* → compute side; attainable = min(100, 10·10) = 100 GFLOP/s; achieved 80 → 80%
    assert p.bound is Bound.COMPUTE
    assert p.intensity == pytest.approx(10.0)
    assert p.pct_compute_roof == pytest.approx(80.0)
    assert p.pct_bandwidth_roof == pytest.approx(80.0)  # 80e9 FLOP/s / 10 FLOP/B = 8 GB/s = 80% of B


def test_just_below_the_ridge_is_memory_bound():
    p = _at(9.9, 0.8)
    # attainable = 10e9·9.9 = 99 GFLOP/s; achieved 79.2 → 79.2% of P; bytes/s = 8 GB/s = 80% of B
    assert p.bound is Bound.MEMORY
    assert p.attainable_flops_per_s == pytest.approx(99e9)
    assert p.pct_compute_roof == pytest.approx(79.2)
    assert p.pct_bandwidth_roof == pytest.approx(80.0)


def test_just_above_the_ridge_is_compute_bound():
    p = _at(10.1, 0.8)
    assert p.bound is Bound.COMPUTE
    assert p.attainable_flops_per_s == pytest.approx(100e9)


def test_far_under_the_roof_is_overhead_bound_either_side():
    # efficiency 0.1 < 0.25 → overhead, whether I is left or right of the ridge
    assert _at(1.0, 0.1).bound is Bound.OVERHEAD
    assert _at(100.0, 0.1).bound is Bound.OVERHEAD


def test_overhead_threshold_edges():
    # exactly at the threshold is not overhead; just under is
    assert _at(1.0, OVERHEAD_BELOW).bound is Bound.MEMORY
    assert _at(1.0, OVERHEAD_BELOW * 0.99).bound is Bound.OVERHEAD
    assert _at(1.0, 0.2).efficiency == pytest.approx(0.2)
    tighter = place(0.3e9, 0.3e9, 1.0, peak_flops=P, peak_bytes_per_s=B, overhead_below=0.5)
    # I = 1 → attainable 10 GFLOP/s; achieved 0.3 → efficiency 0.03 < 0.5
    assert tighter.bound is Bound.OVERHEAD


def test_bytes_only_phase_sits_on_the_bandwidth_roof():
    # a sync moving 6 GB in 1 s on a 10 GB/s device: 60% of the bandwidth roof → memory
    p = place(0.0, 6e9, 1.0, peak_flops=P, peak_bytes_per_s=B)
    assert (p.bound, p.efficiency, p.pct_bandwidth_roof) == (Bound.MEMORY, pytest.approx(0.6), pytest.approx(60.0))
    assert place(0.0, 1e9, 1.0, peak_flops=P, peak_bytes_per_s=B).bound is Bound.OVERHEAD  # 10%


def test_unknown_peaks_or_cost_never_give_a_verdict():
    assert place(1e9, 1e8, 1.0, peak_flops=None, peak_bytes_per_s=B).bound is Bound.UNKNOWN
    assert place(1e9, 1e8, 1.0, peak_flops=P, peak_bytes_per_s=None).bound is Bound.UNKNOWN
    nothing = place(0.0, 0.0, 2.0, peak_flops=P, peak_bytes_per_s=B)
    assert nothing.bound is Bound.UNKNOWN and nothing.flops_per_s is None
    with pytest.raises(ValueError, match="seconds=-1"):
        place(1.0, 1.0, -1, peak_flops=P, peak_bytes_per_s=B)


def test_bound_serializes_as_plain_string():
    assert Bound.OVERHEAD.value == "overhead" and str(Bound.COMPUTE) == "compute"
