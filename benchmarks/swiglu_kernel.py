"""The gated MLP's elementwise backward alone: the C kernel (`native.swiglu`) against the PyTorch ops it
replaces (`fused_mlp._silu_mul_backward` with the kernel off: the SiLU and the product recomputed, the
gradients through up and gate, `aten.silu_backward`).

Shapes: the tokens of one micro-batch at tiny-30m's intermediate width (1,408) as `benchmarks/scaling.py`'s
cases make them (GRPO 16 sequences of a 16-token prompt and ~30 / ~104 completion tokens, DPO 8 pairs), and
SmolLM2-135M's width (1,536) at its GRPO case. bf16; CPU seconds, the median of `--reps` calls, the two ways
alternating in one process; each call allocates its outputs, as in a step.

    python benchmarks/swiglu_kernel.py --threads 1 --reps 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.models import fused_mlp
from posttrain.native import swiglu

SHAPES = [  # (label, tokens, intermediate width)
    ("grpo tiny-30m @ 32", 520, 1408), ("grpo tiny-30m @ 128", 1700, 1408), ("dpo 64", 900, 1408),
    ("dpo 256", 3635, 1408), ("dpo 1,024", 14400, 1408), ("grpo smollm2 @ 64", 1100, 1536),
]


def call(way: str, gate, up, grad) -> float:
    usable = swiglu.usable
    if way == "torch":
        swiglu.usable = lambda *a: None
    try:
        t0 = time.process_time()
        fused_mlp._silu_mul_backward(gate, up, grad, product=True)
        return time.process_time() - t0
    finally:
        swiglu.usable = usable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lib = swiglu.library()
    if lib is None:
        raise SystemExit("swiglu_kernel.py: the C kernel is unavailable here (the warning above says why)")
    print(f"vector path: {'AVX-512' if lib.posttrain_swiglu_vector_path() else 'plain C (compiler-vectorised)'}; "
          f"torch {torch.__version__}, {a.threads} thread(s)")
    print("| shape | tokens × width | C ms | PyTorch ms | PyTorch / C |")
    print("|---|---|---|---|---|")
    for label, tokens, width in SHAPES:
        g = torch.Generator().manual_seed(0)
        gate, up, grad = ((torch.randn(tokens, width, generator=g) * s).bfloat16() for s in (3, 1, 1))
        times: dict[str, list[float]] = {"c": [], "torch": []}
        call("c", gate, up, grad), call("torch", gate, up, grad)  # warm-up
        for rep in range(a.reps):
            for way in (("c", "torch") if rep % 2 == 0 else ("torch", "c")):
                times[way].append(call(way, gate, up, grad))
        c, t = (statistics.median(times[w]) * 1e3 for w in ("c", "torch"))
        print(f"| {label} | {tokens:,} × {width:,} | {c:.2f} | {t:.2f} | {t / c:.2f} |", flush=True)


if __name__ == "__main__":
    main()
