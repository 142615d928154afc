"""Token log-probs over a vocabulary alone: the C kernel (`native.logprobs`) against the PyTorch ops it
replaces (`losses.logprobs` with the kernel off: the chunked logsumexp and gather, the recomputed
softmax backward, `entropy_from_logits`'s softmax).

One call = what a policy update asks of the logits: the log-probs of the completion tokens forward and
backward, and the entropies (no gradient). Shapes: the kept columns of `benchmarks/scaling.py`'s cases
(tiny-30m's 512-token vocabulary at GRPO @ 32, SmolLM2-135M's 49,152 at GRPO @ 64) and a 151,936-token
vocabulary (Qwen2.5's) at 256 positions. bf16 and fp32 logits; CPU seconds, the median of `--reps`
calls, the two ways alternating in one process.

    python benchmarks/logprobs_kernel.py --threads 1 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.losses import entropy_from_logits, token_logprobs
from posttrain.native import logprobs

SHAPES = [  # (label, positions, vocabulary)
    ("grpo tiny-30m @ 32", 480, 512), ("grpo smollm2 @ 64", 752, 49152), ("qwen2.5 vocabulary", 256, 151936),
]


def call(way: str, logits, tokens, grad) -> float:
    usable = logprobs.usable
    if way == "torch":
        logprobs.usable = lambda grid: None
    try:
        z = logits.detach().requires_grad_()
        t0 = time.process_time()
        (token_logprobs(z, tokens) * grad).sum().backward()
        entropy_from_logits(logits)
        return time.process_time() - t0
    finally:
        logprobs.usable = usable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lib = logprobs.library()
    if lib is None:
        raise SystemExit("logprobs_kernel.py: the C kernel is unavailable here (the warning above says why)")
    print(f"vector path: {'AVX-512' if lib.posttrain_logprobs_vector_path() else 'plain C (compiler-vectorised)'}; "
          f"torch {torch.__version__}, {a.threads} thread(s)")
    print("| shape | positions × vocabulary | dtype | C ms | PyTorch ms | PyTorch / C |")
    print("|---|---|---|---|---|---|")
    for label, positions, vocab in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator().manual_seed(0)
            logits = (torch.randn(positions, vocab, generator=g) * 3).to(dtype)
            tokens = torch.randint(0, vocab, (positions,), generator=g)
            grad = torch.randn(positions, generator=g)
            times: dict[str, list[float]] = {"c": [], "torch": []}
            call("c", logits, tokens, grad), call("torch", logits, tokens, grad)  # warm-up
            for rep in range(a.reps):
                for way in (("c", "torch") if rep % 2 == 0 else ("torch", "c")):
                    times[way].append(call(way, logits, tokens, grad))
            c, t = (statistics.median(times[w]) * 1e3 for w in ("c", "torch"))
            name = str(dtype).removeprefix("torch.")
            print(f"| {label} | {positions:,} × {vocab:,} | {name} | {c:.2f} | {t:.2f} | {t / c:.2f} |", flush=True)


if __name__ == "__main__":
    main()
