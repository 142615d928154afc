"""Which decode-matmul form is fastest on this machine: measured once per machine, then remembered.

The fused decode step multiplies every layer's weights by a few rows of activations. Which GEMM does
that fastest depends on the CPU, not only on the dtype and the row count: on the Intel Xeon this
engine was first tuned on, MKL's packed sgemm won for fp32 at 2–32 rows and `torch.mv` for one bf16
row; on an AMD EPYC (Zen 4) both run at a third of oneDNN's packed GEMM (tiny-30m weights streaming
from memory, 2 threads: fp32 8 rows 724 µs `mm` / 761 µs MKL packed / 279 µs oneDNN per
2816 × 512 weight; bf16 one row 346 µs `mv` / 85 µs oneDNN). MKL picks slow code paths on non-Intel
CPUs. So `tuned_kind` times the candidate forms (`projections.PROJECTION_KINDS` this torch build and dtype
support) on the model's own fused weights — one pass over every layer, as a decode step does, the
best of a few, the forms taking turns — and keeps the fastest unless the static choice
(`projections.projection_kind`) is within 5% of it.

The choice is remembered per process and on disk (`$POSTTRAIN_CACHE_DIR` or ~/.cache/posttrain,
`matmul-<host>.json`), keyed by CPU, torch version, thread count, dtype, row bucket (the next power of
two) and weight shapes: every later run on this machine makes the same choice, so its round-off — and
with it a resumed run's samples — does not depend on one noisy measurement. A measurement costs one
packing of the weights per candidate per round and a few passes (0.4–1.6 s for tiny-30m, once).
Non-CPU devices keep the static choice; `POSTTRAIN_MATMUL_TUNE=0` turns measuring off everywhere.
Cache-resident weights (under `projections.PACK_MIN_BYTES`) were left on the static `mm` until our
own packed matmul (form `c`, `ckernels.py`) beat MKL there too (tiny-1m's shapes at 64 rows, 2
threads: 12–56 µs against 15–80 µs), so they are measured as well (~0.1 s for tiny-1m).
Each choice keeps the machine's load average per core when it was measured; one made under load
(≥ 0.5 per core) is measured again once the machine is quieter by 0.5 per core — the one case where a
later run may choose differently (and round off differently) than the run that measured.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path

import torch

from posttrain.rollout.cpu.interfaces import DecodeWeights
from posttrain.rollout.cpu.projections import FORMS, make_projection, projection_kind
from posttrain.telemetry.devices import BUSY_PER_CORE, cache_dir, cpu_name, machine_load

ENV_TUNE = "POSTTRAIN_MATMUL_TUNE"
MARGIN = 0.05  # another form must beat the static choice by this much to replace it
METHOD = 2     # `measure`'s version, kept with each cached choice: 2 = forms in turns over rounds
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_memo: dict[str, str] = {}


def rows_bucket(rows: int) -> int:
    """The row count a choice is measured at and shared by: the next power of two (≤ 256)."""
    return next((b for b in BUCKETS if b >= rows), BUCKETS[-1])


def candidates(dtype: torch.dtype, rows: int) -> list[str]:
    """The forms this torch build can run for `dtype` weights and `rows` rows."""
    return [name for name, form in FORMS.items() if form.available(dtype, rows)]


def cache_file() -> Path:
    return cache_dir() / f"matmul-{socket.gethostname()}.json"


def _key(weights: DecodeWeights, dtype: torch.dtype, bucket: int) -> str:
    lw = weights.layers[0]
    shapes = "/".join("x".join(map(str, t.shape)) for t in (lw.wqkv, lw.wo, lw.wgu, lw.wd))
    return (f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {dtype} | "
            f"{bucket} rows | {len(weights.layers)} × {shapes}")


def _read_cache() -> dict[str, dict]:
    try:
        obj = json.loads(cache_file().read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _write_cache(key: str, entry: dict) -> None:
    """Add one choice to the cache file (written whole to a temporary file, then renamed)."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache = _read_cache()
        cache[key] = entry
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: the choice still holds for this process


def measure(weights: DecodeWeights, kinds: list[str], rows: int, rounds: int = 4, reps: int = 2) -> dict[str, float]:
    """Seconds of one pass of every layer's four decode matmuls in each form: the best pass over
    `rounds` rounds, each of which builds every form in turn and times `reps` passes after a warm-up.

    The forms take turns (round-robin) because a shared machine's speed can drift by tens of percent
    over seconds: timed one after another, a form measured in a slow moment lost to a slower one (the
    AMD EPYC, fp32, 1 row: `mm` 7.2 vs oneDNN 7.8 ms cached, where interleaved rounds give oneDNN
    5.6–7.4 vs `mm` 7.2–9.5 ms). One form's packed copies are alive at a time.
    """
    g = torch.Generator().manual_seed(0)
    seconds = dict.fromkeys(kinds, math.inf)
    for _ in range(rounds):
        for kind in kinds:
            projections = [make_projection(w, b, kind, rows) for lw in weights.layers
                           for w, b in ((lw.wqkv, lw.bqkv), (lw.wo, lw.bo), (lw.wgu, None), (lw.wd, None))]
            xs = [torch.randn(rows, p.in_features, generator=g).to(p.dtype) for p in projections]
            for rep in range(reps + 1):
                t0 = time.perf_counter()
                for p, x in zip(projections, xs):
                    p(x)
                if rep:  # the first pass warms caches and the packed layout: not timed
                    seconds[kind] = min(seconds[kind], time.perf_counter() - t0)
            del projections
    return seconds


def tuned_kind(weights: DecodeWeights, dtype: torch.dtype, rows: int, device: torch.device) -> str:
    """The decode-matmul form for `rows` rows of these weights: measured (once per machine) on a CPU;
    else `projection_kind`'s static choice."""
    static = projection_kind(dtype, rows, device, weights.nbytes)
    if device.type != "cpu" or os.environ.get(ENV_TUNE) == "0":
        return static
    bucket = rows_bucket(rows)
    kinds = candidates(dtype, bucket)
    if len(kinds) == 1:
        return static
    key = _key(weights, dtype, bucket)
    if key in _memo:
        return _memo[key]
    entry = _read_cache().get(key)
    kind = entry.get("kind") if isinstance(entry, dict) else None
    measured = entry.get("us_per_pass") if isinstance(entry, dict) else None
    # made again: a choice by an older `measure`, or among other forms than this build offers (a new one),
    # or one measured under load (≥ BUSY_PER_CORE per core) when the machine is now quieter by that much
    # — the timings it compared were other jobs' noise as much as the forms' speed
    load = entry.get("load_per_core") if isinstance(entry, dict) else None
    under_load = isinstance(load, (int, float)) and load >= BUSY_PER_CORE \
        and machine_load()["load_per_core"] < load - BUSY_PER_CORE
    if kind not in kinds or entry.get("method") != METHOD or not isinstance(measured, dict) \
            or set(measured) != set(kinds) or under_load:
        seconds = measure(weights, kinds, bucket)
        fastest = min(seconds, key=seconds.get)
        kind = static if seconds.get(static, math.inf) <= seconds[fastest] * (1 + MARGIN) else fastest
        _write_cache(key, {"kind": kind, "static": static, "method": METHOD,
                           "us_per_pass": {k: round(v * 1e6) for k, v in seconds.items()},
                           "load_per_core": round(machine_load()["load_per_core"], 2)})
    _memo[key] = kind
    return kind
