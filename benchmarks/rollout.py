"""Rollout speed: the native engine vs `transformers` `generate`, side by side in one process.

    python benchmarks/rollout.py                       # the issue's grid, fp32 and bf16 tables
    python benchmarks/rollout.py --threads 2 --reps 5  # more threads / repetitions

Same model object, same prompts (mixed lengths), same sampling settings on both sides: temperature
1.0, top-p 1, top-k 0, 64 new tokens, EOS ends a row on both sides. tokens/s counts generated
tokens (the completion mask, EOS included). Each repetition runs `generate` then native back to back
and the table shows the median of the repetitions (one warm-up run each is discarded), so load from
other processes hits both sides alike; the ratio is the number to read, absolute tokens/s move with
the machine's load.

Roofline: each row is placed on the CPU roofline with the telemetry's analytic cost model
(`posttrain.telemetry.costs.decode`: FLOPs and minimum bytes of prefill + decode) and the CPU peaks
cached by `posttrain roofline --measure` (or POSTTRAIN_PEAK_* overrides). Without peaks, only the
achieved FLOP/s, bytes/s and intensity are printed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from posttrain.models import build_tiny, count_parameters, train_tokenizer
from posttrain.rollout import SamplingParams, make_engine

GRID = [("tiny-1m", 8), ("tiny-1m", 64), ("tiny-30m", 1), ("tiny-30m", 8), ("tiny-30m", 64)]
TARGET = {("tiny-1m", 8): 3.0, ("tiny-1m", 64): 3.0, ("tiny-30m", 1): 2.0, ("tiny-30m", 8): 2.0, ("tiny-30m", 64): 2.0}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def corpus(n: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["what", "is", "plus", "minus", "times", "the", "answer", "sum", "of", "and", "equals", "compute"]
    return [f"{rng.choice(words)} {rng.choice(words)} {rng.randint(0, 999)} {rng.choice('+-*')} "
            f"{rng.randint(0, 999)} = {rng.randint(0, 99999)}" for _ in range(n)]


def roofline_hook(config, *, batch: int, prompt_len: int, new_tokens: int, dtype: str, seconds: float) -> str:
    """Place one run on the roofline via posttrain.telemetry (empty string if telemetry is unavailable)."""
    try:
        from posttrain.telemetry import costs, devices, roofline
    except ImportError:  # HOOK: the telemetry package is not there yet
        return "roofline: posttrain.telemetry not available"
    cost = costs.decode(config, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, dtype=dtype)
    peaks = devices.detect("cpu", dtype)
    p = roofline.place(cost.flops, cost.bytes, seconds, peak_flops=peaks.flops_for(dtype),
                       peak_bytes_per_s=peaks.bytes_per_s)
    parts = [f"{cost.flops / seconds / 1e9:6.2f} GFLOP/s", f"{cost.bytes / seconds / 1e9:6.2f} GB/s",
             f"I={cost.flops / cost.bytes:5.1f} FLOP/B"]
    if p.pct_compute_roof is not None:
        parts.append(f"{p.pct_compute_roof:5.1f}% compute roof")
    if p.pct_bandwidth_roof is not None:
        parts.append(f"{p.pct_bandwidth_roof:5.1f}% bandwidth roof")
    parts.append(f"bound={p.bound.value}")
    return "  ".join(parts)


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    tok = train_tokenizer(corpus(), vocab_size=512)
    texts = corpus(256, seed=1)
    print(f"# rollout benchmark: torch {torch.__version__}, {torch.get_num_threads()} thread(s), vocab {len(tok)}, "
          f"{args.new_tokens} new tokens, temperature 1.0, {args.reps} reps (median), other load on the CPU shared")
    for dname in args.dtypes:
        print(f"\n## weights {dname}\n")
        print("| model | params | batch | generate tok/s | native tok/s | ratio | target | roofline (native) |")
        print("|---|---|---|---|---|---|---|---|")
        for preset, batch in GRID:
            if preset not in args.models:
                continue
            model = build_tiny(preset, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id, seed=0).eval().to(DTYPES[dname])
            engines = {"generate": make_engine("hf", model, tok), "native": make_engine("native", model, tok)}
            # mixed prompt lengths: 6..17 tokens
            prompts = [tok(texts[i])["input_ids"][: 6 + (i * 5) % 12] for i in range(batch)]
            rates: dict[str, list[float]] = {k: [] for k in engines}
            secs: dict[str, list[float]] = {k: [] for k in engines}
            for rep in range(args.reps + 1):
                params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens, seed=rep)
                for name, engine in engines.items():
                    t0 = time.perf_counter()
                    out = engine.generate(prompts, params)
                    dt = time.perf_counter() - t0
                    if rep:  # rep 0 warms up both
                        rates[name].append(int(out.completion_mask.sum()) / dt)
                        secs[name].append(dt)
            g, n = statistics.median(rates["generate"]), statistics.median(rates["native"])
            ratio = n / g
            target = TARGET[(preset, batch)]
            plen = max(len(p) for p in prompts)
            roof = roofline_hook(model.config, batch=batch, prompt_len=plen, new_tokens=args.new_tokens,
                                 dtype=dname, seconds=statistics.median(secs["native"]))
            print(f"| {preset} | {count_parameters(model) / 1e6:.1f}M | {batch} | {g:,.0f} | {n:,.0f} | "
                  f"{ratio:.2f}× | ≥{target:.0f}× {'ok' if ratio >= target else 'MISSED'} | {roof} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable when the CPU is shared)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per side (median reported)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--models", nargs="+", default=["tiny-1m", "tiny-30m"])
    run(ap.parse_args())


if __name__ == "__main__":
    main()
