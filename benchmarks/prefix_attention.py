"""The shared-prefix attention kernel's ways of computing its products, side by side: matmuls and an fp32
softmax (probabilities kept in bf16; the softmax in one C pass each way, `native.softmax`), the same with
the softmax in PyTorch ops (`matmul-torch`), fused SDPA under a boolean mask, and fused SDPA over causal
squares [prompt | slot] with no mask; and the matmul way with each sequence's queries in blocks
(`--block`), each block against only the keys it reads (posttrain/models/prefix_attention.py).

One attention call, forward + backward, bf16, the shapes of tiny-30m (8 query heads, 4 KV heads, head
dim 64): GRPO groups (2 rows × G 8, 16-token prompt, N-token slots) and DPO pairs (8 pairs as groups of
two), every group packed into one row with its completions at length N (`Segments`). Times: CPU seconds,
the median of `--reps` calls, the ways interleaved in one process (each rep starts at the next way).
Memory: the peak resident set each way adds, each measured in its own subprocess (`--memory`).

    python benchmarks/prefix_attention.py --threads 1 --reps 5 --memory
    python benchmarks/prefix_attention.py --threads 1 --reps 5 --ways matmul matmul-torch
    python benchmarks/prefix_attention.py --threads 1 --reps 5 --memory --ways causal matmul blocks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from posttrain import native
from posttrain.models import prefix_attention

HQ, HKV, D = 8, 4, 64
WAYS = ("matmul", "sdpa", "causal", "matmul-torch", "blocks")
BLOCK = 128  # queries per block for the `blocks` ways (`--block`)
SHAPES = [  # (label, rows, slots, prefix, slot length)
    ("grpo N=32", 2, 8, 16, 32), ("grpo N=128", 2, 8, 16, 128), ("grpo N=192", 2, 8, 16, 192),
    ("grpo N=240", 2, 8, 16, 240), ("grpo N=512", 2, 8, 16, 512),
    ("dpo 64", 8, 2, 16, 48), ("dpo 192", 8, 2, 48, 144), ("dpo 256", 8, 2, 64, 192), ("dpo 1024", 8, 2, 256, 768),
]


class _Module:
    training = False


def call(way: str, rows: int, slots: int, prefix: int, n: int, reps: int = 1) -> list[float]:
    """CPU seconds of `reps` forward + backward calls, `way` forced through the thresholds."""
    prefix_attention.SDPA_FROM = 1 if way in ("sdpa", "causal") else 10**9
    prefix_attention.CAUSAL_FROM = 1 if way == "causal" else 10**9
    # "blocks": the matmul way, each sequence's queries in blocks of at most BLOCK, each block against only the
    # keys it reads
    prefix_attention.QUERY_BLOCK = BLOCK if way == "blocks" else 10**9
    # "matmul-torch": the matmul way with its softmax in PyTorch ops, not the C kernel (native.softmax)
    os.environ[native.ENV_DISABLE] = "0" if way == "matmul-torch" else "1"
    group = prefix + slots * n
    segments = prefix_attention.Segments(
        prefixes=tuple((r * group, prefix) for r in range(rows)),
        slots=tuple(tuple((r * group + prefix + j * n, n) for j in range(slots)) for r in range(rows)))
    mk = lambda h: torch.randn(1, h, rows * group, D, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = mk(HQ), mk(HKV), mk(HKV)
    mask = torch.ones(1, 1, 1, rows * group, dtype=torch.bool)
    out = []
    for _ in range(reps):
        t0 = time.process_time()
        o, _ = prefix_attention.shared_prefix_attention(_Module(), q, k, v, mask, D**-0.5, segments=segments)
        o.float().sum().backward()
        out.append(time.process_time() - t0)
        q.grad = k.grad = v.grad = None
    return out


def _high_water_kib() -> int:
    """This process's peak resident set (VmHWM, KiB). Not `ru_maxrss`: Linux carries that over from the
    parent across fork + exec, so a child of a large parent would read the parent's peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def main() -> None:
    global BLOCK
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--memory", action="store_true", help="also the peak memory each way adds (subprocesses)")
    ap.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS),
                    help="which ways, the first the one the others are divided by")
    ap.add_argument("--block", type=int, default=BLOCK, help="queries per block for the `blocks` ways")
    ap.add_argument("--shapes", nargs="+", help="only these shapes (labels as in the table, e.g. 'dpo 256')")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: "way,rows,slots,prefix,n" → peak MiB added
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    BLOCK = a.block
    if a.one:
        way, *dims = a.one.split(",")
        base = _high_water_kib()
        call(way, *map(int, dims))
        print(json.dumps((_high_water_kib() - base) / 1024))
        return
    ways = tuple(a.ways)
    print("| shape | keys per slot query | " + " | ".join(f"{w} ms" for w in ways) + " | "
          + " | ".join(f"{w} / {ways[0]}" for w in ways[1:]) + " |"
          + (f" peak MiB {' / '.join(ways)} |" if a.memory else ""))
    print("|---|---|" + "---|" * (2 * len(ways) - 1) + ("---|" if a.memory else ""))
    for label, rows, slots, prefix, n in (s for s in SHAPES if not a.shapes or s[0] in a.shapes):
        times: dict[str, list[float]] = {w: [] for w in ways}
        call(ways[0], rows, slots, prefix, n)  # warm-up
        for rep in range(a.reps):
            k = rep % len(ways)
            for way in ways[k:] + ways[:k]:
                times[way] += call(way, rows, slots, prefix, n)
        ms = [statistics.median(times[w]) * 1e3 for w in ways]
        row = (f"| {label} | {prefix + n} | " + " | ".join(f"{t:.1f}" for t in ms) + " | "
               + " | ".join(f"{t / ms[0]:.2f}" for t in ms[1:]) + " |")
        if a.memory:
            mem = [json.loads(subprocess.run([sys.executable, __file__, "--threads", str(a.threads), "--block", str(BLOCK), "--one",
                                              f"{w},{rows},{slots},{prefix},{n}"], capture_output=True, text=True,
                                             check=True).stdout) for w in ways]
            row += " " + " / ".join(f"{m:.0f}" for m in mem) + " |"
        print(row, flush=True)

if __name__ == "__main__":
    main()
