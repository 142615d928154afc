"""The busy line: a background sampler of the number a dashboard would show.

- NVIDIA GPU: NVML `utilization.gpu` (via `nvidia-ml-py`, imported only when used) — "percent of time
  over the past sample period during which one or more kernels was executing on the GPU" (NVML API
  reference, nvmlUtilization_t). One tiny kernel running keeps it at 100%: it says the GPU was
  *occupied*, not how much of it worked.
- CPU: the fraction of wall time the process's threads were running, per core in use —
  Δ(user + system CPU seconds of the process, from psutil) / (Δwall × cores in use), clipped to 0..1,
  with cores in use = `torch.get_num_threads()` bounded by the cores the process may run on. A thread
  spinning in Python, or waiting in an OpenMP barrier, counts as busy, just as it does in `top`.

The sampler is one daemon thread reading the source every 1/hz seconds (default 20 Hz). Each sample
covers the interval since the previous one; a phase's busy is the mean of the samples whose interval
midpoint falls inside the phase (minus its children), None when none does (phases shorter than the
sample period).

Departures:
1. NVML itself averages `utilization.gpu` over a driver-chosen window (1/6 s to 1 s depending on the
   product), so samples taken faster than that repeat values; phases shorter than the window read the
   neighbouring phases' activity.
2. The CPU figure includes the sampler thread's own CPU time (one psutil call per sample, ~20 µs).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import psutil
import torch


class BusySource(Protocol):
    """A reading of 'how busy was the device since my previous read', 0..1 (None if unavailable)."""

    name: str

    def read(self) -> float | None: ...

    def close(self) -> None: ...


def cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class CpuBusy:
    """Process CPU time over wall time, per core in use (see module docstring)."""

    name = "cpu: process CPU time / (wall × cores in use)"

    def __init__(self, cores_in_use: int | None = None) -> None:
        cores = cores_in_use if cores_in_use is not None else torch.get_num_threads()
        self.cores = max(1, min(int(cores), cores_available()))
        self._proc = psutil.Process()
        self._last_cpu, self._last_wall = self._now()

    def _now(self) -> tuple[float, float]:
        t = self._proc.cpu_times()
        return t.user + t.system, time.perf_counter()

    def read(self) -> float | None:
        cpu, wall = self._now()
        d_cpu, d_wall = cpu - self._last_cpu, wall - self._last_wall
        self._last_cpu, self._last_wall = cpu, wall
        if d_wall <= 0:
            return None
        return min(1.0, max(0.0, d_cpu / (d_wall * self.cores)))

    def close(self) -> None:
        pass


class NvmlBusy:
    """NVML `utilization.gpu` of one NVIDIA device, as a fraction."""

    name = "nvml: utilization.gpu"

    def __init__(self, index: int) -> None:
        try:
            import pynvml  # provided by the nvidia-ml-py package
        except ImportError as err:
            raise ImportError("the GPU busy line needs NVML bindings: pip install 'posttrain[gpu]' "
                              "(package nvidia-ml-py)") from err
        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(_nvml_index(index))

    def read(self) -> float | None:
        try:
            return self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0
        except self._nvml.NVMLError:
            return None

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


def _nvml_index(torch_index: int) -> int:
    """NVML numbers all GPUs; torch numbers those in CUDA_VISIBLE_DEVICES. Map when it lists indices.

    (Visible devices given as UUIDs are not mapped: the first visible GPU is assumed to be NVML 0.)
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if entries and all(e.isdigit() for e in entries) and torch_index < len(entries):
        return int(entries[torch_index])
    return torch_index


def source_for(device: torch.device) -> BusySource | None:
    """The busy source for a device: NVML on CUDA (None with a warning when nvidia-ml-py is missing), CPU otherwise."""
    if device.type == "cuda":
        if torch.version.hip is not None:
            return None  # ROCm: no NVML; rocm-smi bindings are not wired in
        try:
            return NvmlBusy(device.index if device.index is not None else torch.cuda.current_device())
        except ImportError as err:
            import warnings
            warnings.warn(f"busy line disabled: {err}", stacklevel=2)
            return None
    if device.type == "cpu":
        return CpuBusy()
    return None


class BusySampler:
    """Reads a BusySource on a daemon thread at `hz`; answers means over time windows."""

    def __init__(self, source: BusySource, hz: float = 20.0, on_tick: Callable[[], None] | None = None) -> None:
        """`on_tick`: called on the sampler's thread with every sample (the sampled-RSS memory meter)."""
        if not hz >= 10.0:
            raise ValueError(f"BusySampler: hz={hz}; the busy line must be sampled at ≥ 10 Hz")
        self.source, self.period, self._tick = source, 1.0 / hz, on_tick
        self._mids: list[float] = []     # interval midpoints, increasing
        self._values: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="posttrain-busy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        self.source.read()  # open the first interval
        while not self._stop.wait(self.period):
            value = self.source.read()
            now = time.perf_counter()
            if self._tick is not None:
                self._tick()
            if value is not None:
                with self._lock:
                    self._mids.append((last + now) / 2)
                    self._values.append(value)
            last = now

    def samples(self, start: float, end: float) -> list[float]:
        """Values of the samples whose interval midpoint lies in [start, end] (perf_counter seconds)."""
        with self._lock:
            lo = bisect.bisect_left(self._mids, start)
            hi = bisect.bisect_right(self._mids, end)
            return self._values[lo:hi]

    def mean(self, start: float, end: float, exclude: list[tuple[float, float]] | None = None) -> float | None:
        """Mean busy over [start, end] without the `exclude` windows; None when no sample fell inside."""
        with self._lock:
            lo = bisect.bisect_left(self._mids, start)
            hi = bisect.bisect_right(self._mids, end)
            mids, values = self._mids[lo:hi], self._values[lo:hi]
        if exclude:
            kept = [v for m, v in zip(mids, values) if not any(s <= m <= e for s, e in exclude)]
        else:
            kept = values
        return sum(kept) / len(kept) if kept else None

    def prune(self, before: float) -> None:
        """Forget samples older than `before` (keeps memory flat over a long run)."""
        with self._lock:
            cut = bisect.bisect_left(self._mids, before)
            del self._mids[:cut], self._values[:cut]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.period + 1.0)
        self.source.close()
