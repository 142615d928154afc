"""The rotary embedding alone, forward + backward of one layer's queries and keys: the C kernel (`native.rope`)
through `fused_attention.rotary`, against `transformers`' own `apply_rotary_pos_emb` under autograd (the ops the
fused attention replaces).

Shapes: the tokens of one micro-batch as `benchmarks/scaling.py`'s cases make them (GRPO 16 sequences of a
16-token prompt and ~30 / ~104 completion tokens, DPO 8 pairs), tiny-30m's heads (8 query, 4 key, head size 64)
and SmolLM2-135M's (9, 3, 64) at its GRPO case. bf16 projections, fp32 angles, as under autocast; CPU seconds,
the median of `--reps` calls, the two ways alternating in one process.

    python benchmarks/rope_kernel.py --threads 1 --reps 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from posttrain.models import fused_attention
from posttrain.native import rope

SHAPES = [  # (label, tokens, query heads, key heads)
    ("grpo tiny-30m @ 32", 520, 8, 4), ("grpo tiny-30m @ 128", 1700, 8, 4), ("dpo 64", 900, 8, 4),
    ("dpo 256", 3635, 8, 4), ("dpo 1,024", 14400, 8, 4), ("grpo smollm2 @ 64", 1100, 9, 3),
]
D = 64


def call(way: str, q, k, cos, sin, gq, gk) -> float:
    q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    t0 = time.process_time()
    if way == "c":
        outs = fused_attention.rotary(q, cos, sin, D), fused_attention.rotary(k, cos, sin, D)
    else:
        outs = apply_rotary_pos_emb(*(t.view(1, t.shape[1], -1, D).transpose(1, 2) for t in (q, k)), cos, sin)
    torch.autograd.backward(outs, (gq, gk))
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if rope.library() is None:
        raise SystemExit("rope_kernel.py: the C kernel is unavailable here (the warning above says why)")
    print(f"torch {torch.__version__}, {a.threads} thread(s); one layer's queries and keys, forward + backward")
    print("| shape | tokens, heads (q, k) | C ms | transformers ms | transformers / C |")
    print("|---|---|---|---|---|")
    for label, tokens, hq, hk in SHAPES:
        g = torch.Generator().manual_seed(0)
        q, k = ((3 * torch.randn(1, tokens, h * D, generator=g)).bfloat16() for h in (hq, hk))
        angles = 50 * torch.randn(1, tokens, D // 2, generator=g)
        emb = torch.cat((angles, angles), -1)
        cos, sin = emb.cos(), emb.sin()
        # the gradients arrive as the attention's backward leaves them: fp32, token-major under (1, H, T, D)
        gq, gk = (torch.randn(1, tokens, h, D, generator=g).transpose(1, 2) for h in (hq, hk))
        times: dict[str, list[float]] = {"c": [], "torch": []}
        call("c", q, k, cos, sin, gq, gk), call("torch", q, k, cos, sin, gq, gk)  # warm-up
        for rep in range(a.reps):
            for way in (("c", "torch") if rep % 2 == 0 else ("torch", "c")):
                times[way].append(call(way, q, k, cos, sin, gq, gk))
        c, t = (statistics.median(times[w]) * 1e3 for w in ("c", "torch"))
        print(f"| {label} | {tokens:,}, ({hq}, {hk}) | {c:.2f} | {t:.2f} | {t / c:.2f} |", flush=True)


if __name__ == "__main__":
    main()
