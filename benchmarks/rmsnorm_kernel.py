"""The fused RMSNorm alone, forward and backward apart: the C kernels (`native.rmsnorm`: the forward's scaling and
cast, the backward) against the PyTorch ops they replace (`fused_norm._RMSNorm` with them off).

Shapes: the tokens of one micro-batch at tiny-30m's width (512) as `benchmarks/scaling.py`'s cases make them
(GRPO 16 sequences of a 16-token prompt and ~30 / ~104 completion tokens, DPO 8 pairs), and SmolLM2-135M's
width (576) at its GRPO case. fp32 rows, a bf16 output and a bf16 incoming gradient, as under autocast; CPU
seconds, the median of `--reps` calls, the two ways alternating in one process.

    python benchmarks/rmsnorm_kernel.py --threads 1 --reps 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.models import fused_norm
from posttrain.native import rmsnorm

SHAPES = [  # (label, tokens, width)
    ("grpo tiny-30m @ 32", 520, 512), ("grpo tiny-30m @ 128", 1700, 512), ("dpo 64", 900, 512),
    ("dpo 256", 3635, 512), ("dpo 1,024", 14400, 512), ("grpo smollm2 @ 64", 1100, 576),
]
USABLE = rmsnorm.usable_forward, rmsnorm.usable


def call(way: str, x, w, grad) -> tuple[float, float]:
    """(forward s, backward s) of one norm."""
    rmsnorm.usable_forward, rmsnorm.usable = USABLE if way == "c" else ((lambda *a: None),) * 2
    try:
        x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        t0 = time.process_time()
        y = fused_norm.rms_norm(x, w, 1e-5, torch.bfloat16)
        t1 = time.process_time()
        y.backward(grad)
        return t1 - t0, time.process_time() - t1
    finally:
        rmsnorm.usable_forward, rmsnorm.usable = USABLE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if rmsnorm.library() is None:
        raise SystemExit("rmsnorm_kernel.py: the C kernels are unavailable here (the warning above says why)")
    print(f"torch {torch.__version__}, {a.threads} thread(s); one norm, ms")
    print("| shape | tokens × width | forward C | forward PyTorch | backward C | backward PyTorch |")
    print("|---|---|---|---|---|---|")
    for label, tokens, width in SHAPES:
        g = torch.Generator().manual_seed(0)
        x, w = 3 * torch.randn(tokens, width, generator=g), 1 + 0.1 * torch.randn(width, generator=g)
        grad = torch.randn(tokens, width, generator=g).bfloat16()
        times: dict[str, list[tuple[float, float]]] = {"c": [], "torch": []}
        call("c", x, w, grad), call("torch", x, w, grad)  # warm-up
        for rep in range(a.reps):
            for way in (("c", "torch") if rep % 2 == 0 else ("torch", "c")):
                times[way].append(call(way, x, w, grad))
        med = {(way, i): statistics.median(t[i] for t in times[way]) * 1e3 for way in times for i in (0, 1)}
        cf, cb, tf, tb = med["c", 0], med["c", 1], med["torch", 0], med["torch", 1]
        print(f"| {label} | {tokens:,} × {width} | {cf:.2f} | {tf:.2f} | {cb:.2f} | {tb:.2f} |", flush=True)


if __name__ == "__main__":
    main()
