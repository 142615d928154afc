"""The busy sampler: rate ≥ 10 Hz, window means, and the CPU source's reading of spinning vs sleeping."""

from __future__ import annotations

import time

import pytest

from posttrain.telemetry.busy import BusySampler, CpuBusy


class Scripted:
    """A busy source returning a value set by the test."""

    name = "scripted"

    def __init__(self) -> None:
        self.value: float | None = 0.0
        self.reads = 0

    def read(self) -> float | None:
        self.reads += 1
        return self.value

    def close(self) -> None:
        pass


def test_rate_and_window_means():
    source = Scripted()
    sampler = BusySampler(source, hz=50.0)
    try:
        source.value = 0.2
        t0 = time.perf_counter()
        time.sleep(0.3)
        t1 = time.perf_counter()
        source.value = 1.0
        time.sleep(0.3)
        t2 = time.perf_counter()
    finally:
        sampler.close()
    n = len(sampler.samples(t0, t2))
    # 50 Hz over 0.6 s ≈ 30 samples; ≥ 10 Hz means ≥ 6 — allow a loaded CPU to drop to 12
    assert n >= 12
    # midpoint windows can straddle a switch by one sample: each half reads its value ± one sample
    assert sampler.mean(t0 + 0.05, t1 - 0.05) == pytest.approx(0.2)
    assert sampler.mean(t1 + 0.05, t2) == pytest.approx(1.0)
    # excluding the second half leaves only the 0.2 samples
    assert sampler.mean(t0 + 0.05, t2, exclude=[(t1 - 0.03, t2)]) == pytest.approx(0.2)
    assert sampler.mean(t2 + 10, t2 + 11) is None  # no sample inside → None, not 0
    sampler.prune(t1)
    assert sampler.samples(t0, t1 - 0.03) == []


def test_sampler_refuses_slow_rates():
    with pytest.raises(ValueError, match="hz=5"):
        BusySampler(Scripted(), hz=5)


def test_cpu_source_reads_spinning_high_and_sleeping_low():
    source = CpuBusy(cores_in_use=1)
    source.read()
    time.sleep(0.2)
    sleeping = source.read()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass  # spin one core
    spinning = source.read()
    assert sleeping is not None and sleeping < 0.2  # asleep: ~0 CPU seconds per wall second
    # spinning: ~1 CPU second per wall second on one core; a CPU shared by 6 runnable jobs on 2 cores
    # still gives us ~1/3 of one, so > 0.25
    assert spinning is not None and spinning > 0.25
    assert 0.0 <= spinning <= 1.0
