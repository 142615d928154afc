"""Memory per phase: the peak resident (CPU) or allocated/reserved (CUDA) memory while a phase ran.

The most common complaint of RL post-training is running out of memory — the policy, its optimizer
state, a frozen reference copy, the rollout engine's weights and KV cache all on one device — so each
phase records the high-water mark it reached, not a sample of it:

- CPU (Linux): the kernel's own peak resident set size, `VmHWM` of /proc/self/status, reset at the
  start of every phase by writing "5" to /proc/self/clear_refs (proc(5): "reset the peak resident set
  size … to the process's current resident set size", Linux ≥ 4.0). Exact: an allocation that lives
  1 ms between two samples is still counted — to the kernel's precision: it folds each thread's RSS
  counter in every 64 page faults, so a reading lags by up to 64 pages per thread (measured: 0.2 MB
  short of a 256 MiB tensor). Where clear_refs cannot be written (macOS, a locked-down
  container) the peak is the largest of the RSS read at the phase's start, its end, and the busy
  sampler's 20 Hz RSS samples in between (`SampledRss`): a lower bound.
- CUDA: `torch.cuda.max_memory_allocated` / `max_memory_reserved`, reset per phase with
  `torch.cuda.reset_peak_memory_stats` — host-side counters of the caching allocator, no device sync.

Nesting: a peak counter is one per process, so entering a child phase folds the peak so far into
every open frame before resetting; leaving it folds the child's peak into its parent. A phase's peak
is therefore inclusive of its children (memory, unlike time, is not exclusive). Phases on other
threads share the one counter: their peaks are those of the process over the window.

`consumers()` names the largest known holders of memory (weights, optimizer state, a reference
copy, the engine's fused weights and KV cache) from the objects themselves, for the report.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil
import torch

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class MemoryReading:
    """A phase's memory: peak bytes over it, the bytes in use when it began, and what was counted."""

    peak: int                # high-water mark during the phase (bytes)
    start: int               # in use at its start (bytes): peak − start is what the phase itself added
    reserved: int | None     # CUDA: peak reserved by the caching allocator; None on a CPU


class MemoryMeter(Protocol):
    """A process-wide peak counter that can be read and reset."""

    kind: str                       # "rss" | "rss-sampled" | "cuda"

    def current(self) -> int: ...

    def peak(self) -> int: ...       # high-water mark since the last reset

    def reserved_peak(self) -> int | None: ...

    def reset(self) -> None: ...


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise OSError(f"{_STATUS}: no {field} line")


class KernelRss:
    """Linux: VmRSS / VmHWM of /proc/self/status, the peak reset through /proc/self/clear_refs."""

    kind = "rss"

    def __init__(self) -> None:
        self.reset()  # raises OSError where clear_refs cannot be written: the caller falls back
        self.peak()

    def current(self) -> int:
        return 1024 * _status_kib("VmRSS:")

    def peak(self) -> int:
        return 1024 * _status_kib("VmHWM:")

    def reserved_peak(self) -> int | None:
        return None

    def reset(self) -> None:
        with _CLEAR.open("w") as f:
            f.write("5")


class SampledRss:
    """Elsewhere: psutil's RSS, the peak the largest of the reads since the last reset (a lower bound).

    `sample()` is called by the busy sampler's thread (20 Hz) so a long phase is seen between its ends."""

    kind = "rss-sampled"

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._peak = self.current()

    def current(self) -> int:
        return int(self._proc.memory_info().rss)

    def sample(self) -> None:
        self._peak = max(self._peak, self.current())

    def peak(self) -> int:
        self.sample()
        return self._peak

    def reserved_peak(self) -> int | None:
        return None

    def reset(self) -> None:
        self._peak = self.current()


class CudaMemory:
    """The CUDA caching allocator's counters for one device (no device synchronization)."""

    kind = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reserved_peak(self) -> int | None:
        return int(torch.cuda.max_memory_reserved(self.device))

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def meter_for(device: torch.device) -> MemoryMeter | None:
    """The meter of a device: CUDA counters, the kernel's peak RSS on Linux, sampled RSS elsewhere."""
    if device.type == "cuda":
        return CudaMemory(device)
    if device.type != "cpu":
        return None  # mps/xpu: not wired in
    if os.environ.get("POSTTRAIN_MEMORY_SAMPLED") != "1":
        try:
            return KernelRss()
        except OSError:
            pass
    return SampledRss()


class PhaseMemory:
    """Per-frame peak bookkeeping over one meter (the nesting rule of the module docstring)."""

    def __init__(self, meter: MemoryMeter) -> None:
        self.meter = meter

    def enter(self, open_frames: list[Any]) -> tuple[int, int]:
        """Fold the peak so far into the open frames, reset the counter; returns (start, start) for the new frame."""
        if open_frames:
            peak, reserved = self.meter.peak(), self.meter.reserved_peak()
            for f in open_frames:
                f._mem_peak = max(f._mem_peak, peak)
                if reserved is not None:
                    f._mem_reserved = max(f._mem_reserved or 0, reserved)
        self.meter.reset()
        now = self.meter.current()
        return now, now

    def leave(self, frame: Any, parent: Any | None) -> MemoryReading:
        peak = max(frame._mem_peak, self.meter.peak())
        reserved = self.meter.reserved_peak()
        if reserved is not None:
            reserved = max(reserved, frame._mem_reserved or 0)
        if parent is not None:
            parent._mem_peak = max(parent._mem_peak, peak)
            if reserved is not None:
                parent._mem_reserved = max(parent._mem_reserved or 0, reserved)
        return MemoryReading(peak=peak, start=frame._mem_start, reserved=reserved)


# ---- the largest known consumers ------------------------------------------------------------------------

def tensor_bytes(tensors: Any) -> int:
    """Bytes of every distinct tensor storage in an iterable (shared storages counted once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's state tensors (AdamW: exp_avg and exp_avg_sq, two copies of the parameters)."""
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values())


def consumers(*, weights: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
              reference: torch.nn.Module | None = None, engine: Any | None = None,
              extra: dict[str, int] | None = None) -> dict[str, int]:
    """The known holders of memory, in bytes, largest first: what a phase's peak is made of.

    `engine`: a rollout engine that says `memory_bytes() -> dict[str, int]` (the native engine: its fused
    weight copies and last KV cache); others are skipped. `extra`: anything else the caller can size
    (an activations estimate)."""
    out: dict[str, int] = {}
    if weights is not None:
        out["weights"] = tensor_bytes(weights.parameters()) + tensor_bytes(weights.buffers())
        grads = tensor_bytes(p.grad for p in weights.parameters() if p.grad is not None)
        if grads:
            out["gradients"] = grads
    if optimizer is not None:
        out["optimizer state"] = optimizer_state_bytes(optimizer)
    if reference is not None:
        out["reference copy"] = tensor_bytes(reference.parameters()) + tensor_bytes(reference.buffers())
    report: Callable[[], dict[str, int]] | None = getattr(engine, "memory_bytes", None)
    if report is not None:
        out.update({f"engine {k}": v for k, v in report().items()})
    out.update(extra or {})
    return dict(sorted(((k, int(v)) for k, v in out.items() if v), key=lambda kv: -kv[1]))
