"""The rollout engine's weight rebuild after a policy update: `FusedWeights.refresh` + the decode forms.

    python benchmarks/weight_refresh.py                      # tiny-30m, fp32 policy → bf16 copies, oneDNN packing
    python benchmarks/weight_refresh.py --dtype fp32 --kind mkl --rows 8

An RL stage calls `engine.update_weights(model)` after every optimizer step, so each rollout starts by
rebuilding the fused copies (norm folded, Q/K paired, cast) and their packed decode forms. This
times that rebuild on its own: a parameter is touched in place before each repetition (as an
optimizer step would), then `refresh()` and `projections(kind, rows)` run; medians of `--reps`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.models import build_tiny
from posttrain.rollout.cpu.fused import FusedWeights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-30m")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the copies' dtype (the policy is fp32)")
    ap.add_argument("--kind", default="dnn", help="decode form: mm, mkl, dnn, mv")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_tiny(args.model, vocab_size=512, seed=0)
    weights = FusedWeights(model, DTYPES[args.dtype])
    first = next(model.parameters())
    refresh, packing = [], []
    for rep in range(args.reps + 1):
        with torch.no_grad():
            first.mul_(1.0)                           # an in-place write: the copies are stale
        t0 = time.perf_counter()
        weights.refresh()
        t1 = time.perf_counter()
        weights.projections(args.kind, args.rows)
        t2 = time.perf_counter()
        if rep:                                       # rep 0 allocates the buffers
            refresh.append(t1 - t0)
            packing.append(t2 - t1)
    r, p = statistics.median(refresh), statistics.median(packing)
    print(f"{args.model} fp32 → {args.dtype} copies, {args.kind} for {args.rows} rows, {args.threads} threads: "
          f"refresh {r * 1e3:.1f} ms + decode forms {p * 1e3:.1f} ms = {(r + p) * 1e3:.1f} ms (median of {args.reps})")


if __name__ == "__main__":
    main()
