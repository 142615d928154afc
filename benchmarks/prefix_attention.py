"""The shared-prefix attention kernel's three ways of computing its products, side by side: matmuls and an
fp32 softmax (probabilities kept in bf16), fused SDPA under a boolean mask, and fused SDPA over causal squares [prompt | slot]
with no mask (posttrain/models/prefix_attention.py).

One attention call, forward + backward, bf16, the shapes of tiny-30m (8 query heads, 4 KV heads, head
dim 64): GRPO groups (2 rows × G 8, 16-token prompt, N-token slots) and DPO pairs (8 pairs as groups of
two), every group packed into one row with its completions at length N (`Segments`). Times: CPU seconds, the median of `--reps` calls, the two ways interleaved in one process. Memory:
the peak resident set each way adds, each measured in its own subprocess (`--memory`).

    python benchmarks/prefix_attention.py --threads 1 --reps 5 --memory
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from posttrain.models import prefix_attention

HQ, HKV, D = 8, 4, 64
SHAPES = [  # (label, rows, slots, prefix, slot length)
    ("grpo N=32", 2, 8, 16, 32), ("grpo N=128", 2, 8, 16, 128), ("grpo N=192", 2, 8, 16, 192),
    ("grpo N=240", 2, 8, 16, 240), ("grpo N=512", 2, 8, 16, 512),
    ("dpo 64", 8, 2, 16, 48), ("dpo 192", 8, 2, 48, 144), ("dpo 256", 8, 2, 64, 192), ("dpo 1024", 8, 2, 256, 768),
]


class _Module:
    training = False


def call(way: str, rows: int, slots: int, prefix: int, n: int, reps: int = 1) -> list[float]:
    """CPU seconds of `reps` forward + backward calls, `way` forced through the thresholds."""
    prefix_attention.SDPA_FROM = 10**9 if way == "matmul" else 1
    prefix_attention.CAUSAL_FROM = 1 if way == "causal" else 10**9
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--memory", action="store_true", help="also the peak memory each way adds (subprocesses)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: "way,rows,slots,prefix,n" → peak MiB added
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.one:
        way, *dims = a.one.split(",")
        base = _high_water_kib()
        call(way, *map(int, dims))
        print(json.dumps((_high_water_kib() - base) / 1024))
        return
    ways = ("matmul", "sdpa", "causal")
    print("| shape | keys per slot query | matmul ms | sdpa ms | causal ms | matmul / sdpa | causal / sdpa |"
          + (" peak MiB matmul / sdpa / causal |" if a.memory else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if a.memory else ""))
    for label, rows, slots, prefix, n in SHAPES:
        times: dict[str, list[float]] = {w: [] for w in ways}
        call("matmul", rows, slots, prefix, n)  # warm-up
        for rep in range(a.reps):
            for way in ways[rep % 3:] + ways[:rep % 3]:
                times[way] += call(way, rows, slots, prefix, n)
        mm, sd, ca = (statistics.median(times[w]) * 1e3 for w in ways)
        row = f"| {label} | {prefix + n} | {mm:.1f} | {sd:.1f} | {ca:.1f} | {mm / sd:.2f} | {ca / sd:.2f} |"
        if a.memory:
            mem = [json.loads(subprocess.run([sys.executable, __file__, "--threads", str(a.threads), "--one",
                                              f"{w},{rows},{slots},{prefix},{n}"], capture_output=True, text=True,
                                             check=True).stdout) for w in ways]
            row += f" {mem[0]:.0f} / {mem[1]:.0f} / {mem[2]:.0f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
