"""The training attention's masked softmax alone: the C kernel (`native.softmax`) against the PyTorch ops it
replaces (`prefix_attention._Softmax` with the kernel off), forward and backward timed apart.

The scores of one bucket of products at tiny-30m's heads (8 query heads = 4 KV heads × 2, bf16), each
product's mask a prefix of its keys as the plan makes it: GRPO slots (16 products of N queries over a
16-token prompt and their own keys) and DPO slots (16 products, 8 pairs, over a quarter-length prompt).
Times: CPU seconds, the median of `--reps` calls, the two ways alternating in one process.

    python benchmarks/softmax_kernel.py --threads 1 --reps 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from posttrain import native
from posttrain.models import prefix_attention
from posttrain.native import softmax as softmax_kernel

HKV, GROUP = 4, 2
SHAPES = [  # (label, products, prompt keys, queries per product)
    ("grpo N=32", 16, 16, 32), ("grpo N=128", 16, 16, 128), ("grpo N=240", 16, 16, 240),
    ("dpo 64", 16, 16, 48), ("dpo 256", 16, 64, 192),
]


def inputs(m: int, ctx: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    keys = ctx + n
    i, k = torch.arange(n), torch.arange(keys)
    allowed = ((k[None] < ctx) | (k[None] - ctx <= i[:, None]))[None].expand(m, n, keys)
    bias = torch.zeros(m, 1, 1, n, keys).masked_fill_(~allowed[:, None, None], float("-inf"))
    limit = allowed.sum(-1, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(m, HKV, GROUP, n, keys, generator=g) * 3).bfloat16()
    grad = torch.randn(m, HKV, GROUP, n, keys, generator=g).bfloat16()
    return scores, bias, limit, grad


def call(way: str, scores, bias, limit, grad) -> tuple[float, float]:
    """CPU seconds of one forward and one backward, `way` "c" (the kernel) or "torch"."""
    os.environ[native.ENV_DISABLE] = "0" if way == "torch" else "1"
    x = scores.clone().requires_grad_()
    t0 = time.process_time()
    probs = prefix_attention._Softmax.apply(x, bias, limit, 0.125, torch.bfloat16)
    t1 = time.process_time()
    probs.backward(grad)
    return t1 - t0, time.process_time() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lib = softmax_kernel.library()
    if lib is None:
        raise SystemExit("softmax_kernel.py: the C kernel is unavailable here (the warning above says why)")
    print(f"vector path: {'AVX2' if lib.posttrain_softmax_vector_path() else 'plain C'}; "
          f"torch {torch.__version__}, {a.threads} thread(s)")
    print("| shape | keys | C fwd ms | PyTorch fwd ms | C bwd ms | PyTorch bwd ms | PyTorch / C, fwd + bwd |")
    print("|---|---|---|---|---|---|---|")
    for label, m, ctx, n in SHAPES:
        args = inputs(m, ctx, n)
        times: dict[str, list[tuple[float, float]]] = {"c": [], "torch": []}
        call("c", *args), call("torch", *args)  # warm-up
        for rep in range(a.reps):
            for way in (("c", "torch") if rep % 2 == 0 else ("torch", "c")):
                times[way].append(call(way, *args))
        f = {w: statistics.median(t[0] for t in times[w]) * 1e3 for w in times}
        b = {w: statistics.median(t[1] for t in times[w]) * 1e3 for w in times}
        print(f"| {label} | {ctx + n} | {f['c']:.1f} | {f['torch']:.1f} | {b['c']:.1f} | {b['torch']:.1f} | "
              f"{(f['torch'] + b['torch']) / (f['c'] + b['c']):.2f} |", flush=True)
    os.environ.pop(native.ENV_DISABLE, None)


if __name__ == "__main__":
    main()
