"""Device peaks: a cited table for accelerators, detection of the running device, CPU measurement.

Every figure is a *dense* peak (no 2:4 structured sparsity — vendor sheets print the sparse figure
first, twice the dense one, marked with an asterisk). `fp32` is the non-tensor-core FP32 rate: what
`torch.matmul` in float32 gets with PyTorch's default `allow_tf32=False`; `tf32` is listed apart.
`bf16`/`fp16` are tensor-core rates with FP32 accumulate (what training uses).

Departures:
1. Peaks are vendor maxima at boost clock; sustained matmul throughput is typically 70–90% of them
   (the H200 here measures ≈790 of 989 TFLOP/s bf16), so a perfectly compute-bound phase will not
   show 100% of the compute roof.
2. A CPU has no datasheet we can trust (turbo, AVX-512/AMX, SMT, the cores a container gets), so
   its roofs are measured, not looked up: `measure_cpu_peaks` (see its docstring for how).
3. An unknown device never yields 0: peaks stay None, verdicts read "unknown", and the message says
   how to give them (environment variables or the recipe's telemetry fields).
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.telemetry.costs import dtype_name

ENV_PEAK_FLOPS = "POSTTRAIN_PEAK_FLOPS"
ENV_PEAK_BYTES = "POSTTRAIN_PEAK_BYTES_PER_S"
ENV_CACHE_DIR = "POSTTRAIN_CACHE_DIR"

HOW_TO_GIVE_PEAKS = (
    f"set {ENV_PEAK_FLOPS}=<dense FLOP/s at the run dtype, e.g. 3.12e14> and "
    f"{ENV_PEAK_BYTES}=<memory bytes/s, e.g. 2.0e12>, or the recipe's telemetry.peak_flops / "
    "telemetry.peak_bytes_per_s; on a CPU run `posttrain roofline --measure`"
)

T = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    """One row of the peaks table: dense FLOP/s per dtype, memory bandwidth in bytes/s, the source."""

    name: str
    flops: dict[str, float]
    bytes_per_s: float
    source: str
    pattern: str  # regex matched (case-insensitive) against torch.cuda.get_device_name()


# Ordered: the first pattern that matches wins, so more specific names come first.
PEAKS_TABLE: tuple[DeviceSpec, ...] = (
    DeviceSpec("NVIDIA H200 NVL", {"fp32": 60.0 * T, "tf32": 417.8 * T, "bf16": 835.6 * T, "fp16": 835.6 * T},
               4.8 * T, "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column (dense)", r"\bH200\b.*NVL"),
    DeviceSpec("NVIDIA H200", {"fp32": 66.9 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T},
               4.8 * T, "NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e at 4.8 TB/s; dense = half the "
               "starred sparse figures, bf16 1,979 → 989.4 TFLOP/s)",
               r"\bH200\b"),
    DeviceSpec("NVIDIA H100 NVL", {"fp32": 60.0 * T, "tf32": 417.8 * T, "bf16": 835.5 * T, "fp16": 835.5 * T},
               3.9 * T, "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column (dense)", r"\bH100\b.*NVL"),
    DeviceSpec("NVIDIA H100 PCIe", {"fp32": 51.2 * T, "tf32": 378.0 * T, "bf16": 756.0 * T, "fp16": 756.0 * T},
               2.0 * T, "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column (dense)",
               r"\bH100\b.*PCIe"),
    DeviceSpec("NVIDIA H100 SXM", {"fp32": 66.9 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T},
               3.35 * T, "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (dense)",
               r"\bH100\b"),
    DeviceSpec("NVIDIA A100 80GB PCIe", {"fp32": 19.5 * T, "tf32": 156.0 * T, "bf16": 312.0 * T, "fp16": 312.0 * T},
               1.935 * T, "NVIDIA A100 datasheet, 80GB PCIe column (dense)", r"\bA100\b.*80GB.*PCIe"),
    DeviceSpec("NVIDIA A100 80GB SXM", {"fp32": 19.5 * T, "tf32": 156.0 * T, "bf16": 312.0 * T, "fp16": 312.0 * T},
               2.039 * T, "NVIDIA A100 datasheet, 80GB SXM column (dense)", r"\bA100\b.*80GB"),
    DeviceSpec("NVIDIA A100 40GB", {"fp32": 19.5 * T, "tf32": 156.0 * T, "bf16": 312.0 * T, "fp16": 312.0 * T},
               1.555 * T, "NVIDIA A100 datasheet, 40GB column (PCIe and SXM share 1,555 GB/s; dense)",
               r"\bA100\b"),
    DeviceSpec("NVIDIA L40S", {"fp32": 91.6 * T, "tf32": 183.0 * T, "bf16": 362.05 * T, "fp16": 362.05 * T},
               0.864 * T, "NVIDIA L40S datasheet (dense; sheet's starred figures are sparse)", r"\bL40S\b"),
    DeviceSpec("NVIDIA L4", {"fp32": 30.3 * T, "tf32": 60.0 * T, "bf16": 121.0 * T, "fp16": 121.0 * T},
               0.300 * T, "NVIDIA L4 datasheet (dense = half of the 242 TFLOP/s sparse bf16)", r"\bL4\b"),
    DeviceSpec("NVIDIA A10G", {"fp32": 35.0 * T, "tf32": 35.0 * T, "bf16": 70.0 * T, "fp16": 70.0 * T},
               0.600 * T, "AWS G5 A10G (no NVIDIA datasheet; figures as compiled by Baseten, 'NVIDIA A10 vs "
               "A10G for ML model inference', 2023 — lower confidence than the other rows)", r"\bA10G\b"),
    DeviceSpec("NVIDIA GeForce RTX 4090", {"fp32": 82.6 * T, "tf32": 82.6 * T, "bf16": 165.2 * T, "fp16": 165.2 * T},
               1.008 * T, "NVIDIA Ada Lovelace architecture whitepaper, appendix (FP16/BF16 tensor with FP32 "
               "accumulate, dense; the 330 TFLOP/s figure is FP16-accumulate)", r"RTX 4090"),
    DeviceSpec("AMD Instinct MI300X", {"fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T},
               5.3 * T, "AMD Instinct MI300X datasheet (dense; 2,614.9 TFLOP/s is with sparsity)", r"MI300X"),
    DeviceSpec("NVIDIA B200", {"fp32": 75.0 * T, "tf32": 1100.0 * T, "bf16": 2250.0 * T, "fp16": 2250.0 * T},
               7.7 * T, "NVIDIA HGX B200 specifications, per GPU (dense = half of the 4.5 PFLOP/s sparse bf16)",
               r"\bB200\b"),
)


@dataclass
class Peaks:
    """The roofs of one device. A missing figure is None, never 0."""

    name: str
    kind: str
    flops: dict[str, float] = field(default_factory=dict)
    bytes_per_s: float | None = None
    source: str = ""

    def flops_for(self, dtype: torch.dtype | str) -> float | None:
        return self.flops.get(dtype_name(dtype))

    def to_json(self, dtype: torch.dtype | str) -> dict[str, Any]:
        """The device.json object of docs/run_dir.md."""
        return {"name": self.name, "kind": self.kind,
                "peaks": {"flops": dict(self.flops), "bytes_per_s": self.bytes_per_s},
                "source": self.source, "dtype": dtype_name(dtype)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Peaks:
        peaks = obj.get("peaks", {})
        return cls(name=obj.get("name", "?"), kind=obj.get("kind", "?"), flops=dict(peaks.get("flops") or {}),
                   bytes_per_s=peaks.get("bytes_per_s"), source=obj.get("source", ""))


def lookup(device_name: str) -> DeviceSpec | None:
    """The table row whose pattern matches a device name such as 'NVIDIA A100-SXM4-80GB'."""
    for spec in PEAKS_TABLE:
        if re.search(spec.pattern, device_name, flags=re.IGNORECASE):
            return spec
    return None


def _env_overrides(peaks: Peaks, dtype: str) -> Peaks:
    flops_env, bytes_env = os.environ.get(ENV_PEAK_FLOPS), os.environ.get(ENV_PEAK_BYTES)
    notes = []
    for var, text in ((ENV_PEAK_FLOPS, flops_env), (ENV_PEAK_BYTES, bytes_env)):
        if text is None:
            continue
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{var}={text!r}: expected a positive number such as 3.12e14") from None
        if not value > 0:
            raise ValueError(f"{var}={text!r}: expected a positive number such as 3.12e14")
        if var == ENV_PEAK_FLOPS:
            peaks.flops[dtype] = value
        else:
            peaks.bytes_per_s = value
        notes.append(f"{var}={text}")
    if notes:
        peaks.source = (peaks.source + "; " if peaks.source else "") + "overridden by " + ", ".join(notes)
    return peaks


def detect(device: torch.device | str, dtype: torch.dtype | str = "fp32", *,
           peak_flops: float | None = None, peak_bytes_per_s: float | None = None,
           measure_cpu: bool = False) -> Peaks:
    """The peaks of `device` at `dtype`: table (CUDA/ROCm), cache or measurement (CPU), then overrides.

    Precedence, last wins: table or CPU cache → env vars → explicit `peak_flops`/`peak_bytes_per_s`
    (the recipe's fields). On a CPU without a cached measurement, `measure_cpu=True` measures now
    (a few seconds, then cached); otherwise the peaks stay unknown.
    """
    device = torch.device(device)
    dt = dtype_name(dtype)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        spec = lookup(name)
        peaks = Peaks(name=name, kind="cuda")
        if spec is not None:
            peaks.flops, peaks.bytes_per_s = dict(spec.flops), spec.bytes_per_s
            peaks.source = f"table: {spec.name} — {spec.source}"
        else:
            peaks.source = f"unknown peak: {name!r} is not in posttrain's table; {HOW_TO_GIVE_PEAKS}"
    elif device.type == "cpu":
        cached = _read_cache()
        measured = None if cached is None else _peaks_from_cache(cached)
        if measure_cpu and (measured is None or dt not in measured.flops or measured_under_load(cached)):
            # none cached, not at this dtype, or cached under load and the machine is quieter now: the
            # run's dtype only (a bf16 matmul on a CPU without bf16 units costs seconds per call)
            measured = measure_cpu_peaks(dtypes=(dt,) if dt in ("fp32", "bf16", "fp16") else ("fp32",))
        peaks = measured or Peaks(name=cpu_name(), kind="cpu",
                                  source=f"unknown peak: no CPU measurement cached; {HOW_TO_GIVE_PEAKS}")
    else:
        peaks = Peaks(name=str(device), kind=device.type,
                      source=f"unknown peak: no table entry for device type {device.type!r}; {HOW_TO_GIVE_PEAKS}")
    peaks = _env_overrides(peaks, dt)
    if peak_flops is not None or peak_bytes_per_s is not None:
        if peak_flops is not None:
            peaks.flops[dt] = float(peak_flops)
        if peak_bytes_per_s is not None:
            peaks.bytes_per_s = float(peak_bytes_per_s)
        peaks.source += "; overridden by the recipe's telemetry peaks"
    return peaks


def missing_peaks_message(peaks: Peaks, dtype: torch.dtype | str) -> str | None:
    """None when both roofs at `dtype` are known; else a sentence saying which is missing and how to give it."""
    missing = []
    if peaks.flops_for(dtype) is None:
        missing.append(f"{dtype_name(dtype)} FLOP/s")
    if peaks.bytes_per_s is None:
        missing.append("memory bytes/s")
    if not missing:
        return None
    return f"unknown peak ({' and '.join(missing)}) for {peaks.name!r}: {HOW_TO_GIVE_PEAKS}"


# ---- CPU ------------------------------------------------------------------------------------------
MEASURE_METHOD = 2   # 2: dtypes and the streaming read interleaved over rounds, machine load recorded
BUSY_PER_CORE = 0.5  # load average per core at or above which a measurement counts as taken under load


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def cache_dir() -> Path:
    """Where per-machine measurements live: `$POSTTRAIN_CACHE_DIR` or ~/.cache/posttrain."""
    return Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "posttrain")


def cache_path() -> Path:
    return cache_dir() / f"roofline-{socket.gethostname()}.json"


def machine_load() -> dict[str, float]:
    """The 1-minute load average and the logical cores: how much else wants this CPU right now."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        load = float("nan")
    cores = float(os.cpu_count() or 1)
    return {"load_1m": load, "cores": cores, "load_per_core": load / cores}


def _read_cache() -> dict[str, Any] | None:
    try:
        obj = json.loads(cache_path().read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(obj, dict) or obj.get("threads") != torch.get_num_threads():
        return None  # measured with a different number of threads: the roof moved
    return obj


def _write_cache(obj: dict[str, Any]) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: the figures still hold for this run


def measured_under_load(obj: dict[str, Any], now: dict[str, float] | None = None) -> bool:
    """True when a cached measurement was taken under load (≥ BUSY_PER_CORE per core, or by an older
    method that did not record the load) and the machine is quieter now: worth measuring again."""
    if obj.get("method") != MEASURE_METHOD:
        return True
    then = float((obj.get("load") or {}).get("load_per_core", float("nan")))
    now = now or machine_load()
    if not then >= BUSY_PER_CORE:
        return False
    return now["load_per_core"] < then - BUSY_PER_CORE  # NaN (no load average) compares False


def _peaks_from_cache(obj: dict[str, Any]) -> Peaks:
    peaks = Peaks.from_json(obj)
    observed = obj.get("observed") or {}
    lifted = []
    for dt, rate in (observed.get("flops") or {}).items():
        if rate > peaks.flops.get(dt, 0.0):
            peaks.flops[dt] = float(rate)
            lifted.append(f"{dt} compute")
    bw = observed.get("bytes_per_s")
    if bw and bw > (peaks.bytes_per_s or 0.0):
        peaks.bytes_per_s = float(bw)
        lifted.append("bandwidth")
    if lifted:
        peaks.source += (f"; {' and '.join(lifted)} roof lifted to the best rate a run's phase achieved on this "
                         f"machine ({observed.get('by', 'a phase')}, {observed.get('at', '?')})")
    return peaks


def load_cpu_peaks() -> Peaks | None:
    """The cached roofs of this machine at the current thread count (lifted by any rate a run observed
    above them), or None."""
    obj = _read_cache()
    return None if obj is None else _peaks_from_cache(obj)


def _best_rate(fn: Any, work: float, seconds: float, best: float = 0.0, warm_up: bool = True) -> float:
    """Best work/s over repeats of fn() for about `seconds` (best, not mean: the roof is a maximum)."""
    if warm_up:
        fn()  # the first call pays allocation and kernel selection
    deadline = time.perf_counter() + seconds
    for calls in range(1, 1 << 30):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best = max(best, work / dt)
        if calls >= 2 and time.perf_counter() > deadline:  # two at least: one may be descheduled midway
            return best
    return best


def _matmul_size(dtype: torch.dtype, largest: int, budget: float, smallest: int = 256) -> int:
    """The matmul size to measure `dtype` at: `largest`, or where one product there would take longer than
    `budget` (a dtype without fast instructions: bf16 on an AVX2 CPU runs ~20× below fp32, a 2048² product
    in about 12 s), the largest power of two from `smallest` whose product fits, by the rate of a
    `smallest`² probe."""
    probe = min(smallest, largest)
    a = torch.randn(probe, probe).to(dtype)
    torch.matmul(a, a)
    t = time.perf_counter()
    torch.matmul(a, a)
    rate = 2.0 * probe**3 / max(time.perf_counter() - t, 1e-9)
    n = largest
    while n > smallest and 2.0 * n**3 / rate > budget:
        n //= 2
    return n


def slow_bf16_reason(device: torch.device | str) -> str | None:
    """Why bf16 matmuls run far below fp32 on this device, or None. On a CPU PyTorch's bf16 matmuls are fast
    where oneDNN has bf16 instructions (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX); without them they take a
    reference path: ~1.4 GFLOP/s against fp32's ~35 on an AVX2 AMD EPYC (6 Dec 2026, 1 thread)."""
    if torch.device(device).type != "cpu" or _onednn_bf16():
        return None
    return (f"this CPU has no bf16 matmul instructions PyTorch can use (its vector level: "
            f"{torch.backends.cpu.get_cpu_capability()}), so bf16 matmuls run on a slow path, far below fp32 "
            f"(`posttrain roofline --measure` shows both)")


def _onednn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no way to tell, say nothing
        return True


def measure_cpu_peaks(*, matmul_n: int = 2048, stream_mib: int = 256, seconds_each: float = 1.0,
                      dtypes: tuple[str, ...] = ("fp32", "bf16"), rounds: int = 3, save: bool = True) -> Peaks:
    """Measure this CPU's roofs with torch, at the current `torch.get_num_threads()`.

    - Compute: best-of-repeats rate of an n × n @ n × n `torch.matmul` per dtype, counted as 2n³ FLOPs.
    - Bandwidth: best-of-repeats rate of `x.sum()` over a `stream_mib` MiB float32 tensor (well past
      the last-level cache), counted as the tensor's bytes read once — a streaming read.
    The measurements are interleaved over `rounds` rounds (every dtype and the read take turns, each
    `seconds_each / rounds` a turn) so a burst of other work on a shared machine depresses one turn,
    not one figure; the best of all turns is kept, and so is a better figure from an earlier
    measurement at the same thread count (a roof is a maximum). The load average before and after is
    recorded with the figures, and the source says when the machine was busy. A dtype whose `matmul_n`
    product would take longer than `seconds_each` is measured at a smaller size (`_matmul_size`; the source
    says so). Takes about `seconds_each` × (len(dtypes) + 1) seconds. Saved to `cache_path()` unless `save=False`.
    """
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    before = machine_load()
    turn = seconds_each / max(1, rounds)
    sizes = {d: _matmul_size(torch_dtype[d], matmul_n, seconds_each) for d in dtypes}
    mats = {d: (torch.randn(sizes[d], sizes[d]).to(torch_dtype[d]), torch.randn(sizes[d], sizes[d]).to(torch_dtype[d]))
            for d in dtypes}
    x = torch.ones(stream_mib * 2**20 // 4, dtype=torch.float32)
    flops = dict.fromkeys(dtypes, 0.0)
    bandwidth = 0.0
    for k in range(max(1, rounds)):
        for d, (a, b) in mats.items():
            flops[d] = _best_rate(lambda a=a, b=b: torch.matmul(a, b), 2.0 * sizes[d]**3, turn, flops[d], k == 0)
        bandwidth = _best_rate(lambda: x.sum(), float(x.numel() * 4), turn, bandwidth, k == 0)
    after = machine_load()
    threads = torch.get_num_threads()
    previous = _read_cache() if save else None
    kept = []
    if previous is not None and previous.get("method") == MEASURE_METHOD:
        old = Peaks.from_json(previous)
        for d in dtypes:
            if old.flops.get(d, 0.0) > flops[d]:
                flops[d] = old.flops[d]
                kept.append(f"{d} compute")
        flops = {**{d: v for d, v in old.flops.items() if d not in flops}, **flops}  # dtypes not measured now
        if (old.bytes_per_s or 0.0) > bandwidth:
            bandwidth = float(old.bytes_per_s)
            kept.append("bandwidth")
    load = {k: max(before[k], after[k]) for k in before}
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    smaller = "".join(f", {d} at {n}x{n} (slow here)" for d, n in sizes.items() if n < matmul_n)
    notes = [f"matmul {matmul_n}x{matmul_n} per dtype{smaller} and a streaming read (sum() over {stream_mib} MiB "
             f"fp32) interleaved over {rounds} rounds, best of repeats ({seconds_each:g}s each)",
             f"at {stamp}, load average {load['load_1m']:.1f} on {load['cores']:.0f} cores"
             + (" — a busy machine: the roofs may read low, and are lifted when a phase exceeds them"
                if load["load_per_core"] >= BUSY_PER_CORE else "")]
    if kept:
        notes.append(f"{', '.join(kept)} kept from an earlier, faster measurement")
    peaks = Peaks(name=cpu_name(), kind="cpu", flops=flops, bytes_per_s=bandwidth,
                  source=(f"measured by posttrain on {socket.gethostname()} with torch {torch.__version__}, "
                          f"{threads} threads: " + "; ".join(notes)))
    if save:
        obj = peaks.to_json("fp32") | {"threads": threads, "measured_at": time.time(), "method": MEASURE_METHOD,
                                       "load": load}
        if previous is not None and previous.get("observed"):
            obj["observed"] = previous["observed"]
        _write_cache(obj)
    return peaks


def note_observed(peaks: Peaks, dtype: str, revisions: list[Any]) -> None:
    """Remember, in this CPU's cache, a roof a run had to lift (`revision.Revision`s): the next run starts
    from it (and re-measures when the measurement was taken under load). No-op for other devices."""
    if peaks.kind != "cpu" or not revisions:
        return
    obj = _read_cache()
    if obj is None:
        return
    observed = obj.setdefault("observed", {})
    for r in revisions:
        if r.roof == "compute" and r.dtype:
            flops = observed.setdefault("flops", {})
            flops[r.dtype] = max(float(flops.get(r.dtype, 0.0)), r.new)
        elif r.roof == "bandwidth":
            observed["bytes_per_s"] = max(float(observed.get("bytes_per_s") or 0.0), r.new)
        observed["by"] = f"{r.stage}·{r.phase} step {r.step}"
    observed["at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    _write_cache(obj)

