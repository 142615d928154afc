"""PyTorch's CPU math library, made exact from a process's first parallel call: `use_threads`.

On an x86 CPU, PyTorch's wheel computes cos, sin, exp, log, tanh, erf and a few more over contiguous
float32 and float64 tensors with MKL's vector math (VML), in chunks its OpenMP threads share. Measured
with torch 2.13.0's CPU wheel (MKL 2024.2) on the 2-core machine: the first time a VML function ran split
over two threads in a process, the second thread's share came back with errors up to 1.5e-4 in 7 of 88
fresh processes over four probes (the rotary embedding's cos over 70 positions × 128 dimensions: the
positions 35–69 wrong, against 3.6e-8 for every later call and for every other process). It was exact in 40 of 40 when the
same function had run once before on one thread, and in 40 of 40 when any parallel op had started the
OpenMP threads before; a non-VML function's first call before (log1p, one thread) left it 4 in 40. So it
is the first call of a VML function racing the threads' start; `prime` does both.

Every transformer with rotary embeddings computes cos and sin in its first forward, so resumes of one
killed run differed from the uninterrupted run in 6 of 25 fresh processes, from the first resumed step's
gradients on (the LoRA kill-and-resume test, tests/test_resume.py, failed in about one full-suite run in
three; docs/lora.md). `use_threads`
calls each such function once on a few elements — one thread, below PyTorch's parallel grain — before
anything else computes; the run, `posttrain eval` and a Ray rollout worker call it where they set their
thread count. tests/test_models_cpu_math.py checks fresh processes' first parallel cos against the
serial one.
"""

from __future__ import annotations

import functools

import torch

# The unary ops PyTorch routes to MKL's VML for float32/float64 (aten/src/ATen/cpu/vml.h); calling one that
# does not go there costs a few microseconds and nothing else.
VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "expm1", "log", "log10", "log1p",
           "log2", "sin", "sqrt", "tan", "tanh", "trunc")


def use_threads(threads: int | None = None) -> None:
    """Set PyTorch's intra-op threads (when `threads` is given) and prime the vector math (`prime`)."""
    if threads:
        torch.set_num_threads(threads)
    prime()


@functools.cache
def prime() -> None:
    """Each `VML_OPS` function once on 16 elements (one thread) of each dtype VML serves, then one parallel
    non-VML op, which starts the OpenMP threads. Once per process."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((16,), 0.5, dtype=dtype)  # inside every op's domain (acos, erfinv, log: |x| < 1, x > 0)
        for op in VML_OPS:
            getattr(torch, op)(x)
    torch.zeros(1 << 18).add_(1.0)  # above PyTorch's parallel grain: the thread pool starts here
