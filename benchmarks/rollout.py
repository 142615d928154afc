"""Rollout speed: the native engine vs `transformers` `generate`, side by side in one process.

    python benchmarks/rollout.py                       # the issue's grid, fp32 and bf16 tables
    python benchmarks/rollout.py --reps 9 --dtypes fp32 --models tiny-30m
    python benchmarks/rollout.py --dtypes bf16 --models tiny-1m --variant compute=bf16   # an engine option A/B

Same model object, same prompts (mixed lengths), same sampling settings on both sides: temperature
1.0, top-p 1, top-k 0, 64 new tokens, EOS ends a row on both sides; `generate` runs with its normal
settings (`use_cache=True`, its own dynamic cache) through the `hf` backend, which also asks it for
the logits so that both sides return per-token log-probs. tokens/s counts generated tokens (the
completion mask, EOS included).

Two clocks per call. Wall time is what a user waits; it swings with whatever else runs on the
machine. Process CPU time (`time.process_time`, 1 torch thread) counts only this process's work,
so it is far steadier when other jobs share the CPU — it still rises when they evict our caches,
but it does so for both sides. Repetitions alternate the order of the two sides (generate first,
then native first, …) after one discarded warm-up each; each repetition gives one paired ratio
native/generate per clock, and the table shows medians (of the rates and of the paired ratios).

Roofline: each row places the native run on the CPU roofline with the telemetry's analytic cost
model (`posttrain.telemetry.costs.decode`: FLOPs and minimum bytes of prefill + decode) and the CPU
peaks cached by `posttrain roofline --measure` (or POSTTRAIN_PEAK_* overrides); without cached
peaks only achieved FLOP/s, bytes/s and intensity are printed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field

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


def bench_case(preset: str, dtype: torch.dtype, batch: int, tok) -> tuple[torch.nn.Module, list[list[int]]]:
    """The benchmark's model (the preset from seed 0, in `dtype`) and `batch` prompts of mixed lengths (6–17 tokens)."""
    model = build_tiny(preset, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id, seed=0).eval().to(dtype)
    texts = corpus(256, seed=1)
    return model, [tok(texts[i])["input_ids"][: 6 + (i * 5) % 12] for i in range(batch)]


def roofline_hook(config, *, batch: int, prompt_len: int, new_tokens: int, dtype: str, seconds: float) -> str:
    """Place one run on the roofline via posttrain.telemetry (a note if telemetry is unavailable)."""
    try:
        from posttrain.telemetry import costs, devices, roofline
    except ImportError:
        return "roofline: posttrain.telemetry not available"
    cost = costs.decode(config, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, dtype=dtype)
    peaks = devices.detect("cpu", dtype)
    p = roofline.place(cost.flops, cost.bytes, seconds, peak_flops=peaks.flops_for(dtype),
                       peak_bytes_per_s=peaks.bytes_per_s)
    parts = [f"{cost.flops / seconds / 1e9:.1f} GFLOP/s", f"{cost.bytes / seconds / 1e9:.2f} GB/s",
             f"I={cost.flops / cost.bytes:.1f} FLOP/B"]
    if p.pct_compute_roof is not None:
        parts.append(f"{p.pct_compute_roof:.0f}% compute roof")
    if p.pct_bandwidth_roof is not None:
        parts.append(f"{p.pct_bandwidth_roof:.0f}% bandwidth roof")
    parts.append(f"bound={p.bound.value}")
    return ", ".join(parts)


@dataclass
class Side:
    wall: list[float] = field(default_factory=list)  # tokens per wall second, one per repetition
    cpu: list[float] = field(default_factory=list)   # tokens per process-CPU second
    cpu_seconds: list[float] = field(default_factory=list)


def timed(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float, float]:
    """(generated tokens, wall seconds, process CPU seconds) of one `generate` call."""
    c0, w0 = time.process_time(), time.perf_counter()
    out = engine.generate(prompts, params)
    w1, c1 = time.perf_counter(), time.process_time()
    return int(out.completion_mask.sum()), w1 - w0, c1 - c0


def measure(engines: dict, prompts: list[list[int]], reps: int, new_tokens: int) -> tuple[dict[str, Side], list[float], list[float]]:
    """Alternate the two sides' order each repetition; return per-side rates and paired ratios (wall, CPU)."""
    sides = {name: Side() for name in engines}
    ratio_wall, ratio_cpu = [], []
    for rep in range(reps + 1):  # rep 0 warms up both sides
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens, seed=rep)
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        got = {name: timed(engines[name], prompts, params) for name in order}
        if rep == 0:
            continue
        for name, (tokens, wall, cpu) in got.items():
            sides[name].wall.append(tokens / wall)
            sides[name].cpu.append(tokens / cpu)
            sides[name].cpu_seconds.append(cpu)
        ratio_wall.append(sides["native"].wall[-1] / sides["generate"].wall[-1])
        ratio_cpu.append(sides["native"].cpu[-1] / sides["generate"].cpu[-1])
    return sides, ratio_wall, ratio_cpu


def parse_variant(text: str) -> dict:
    """`key=value,…` → native-engine options; dtype names become torch dtypes (compute=bf16)."""
    options = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--variant: {item!r} is not key=value")
        options[key.strip()] = DTYPES.get(value.strip(), value.strip())
    return options


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    tok = train_tokenizer(corpus(), vocab_size=512)
    print(f"# rollout benchmark: torch {torch.__version__}, {torch.get_num_threads()} thread(s), vocab {len(tok)}, "
          f"{args.new_tokens} new tokens, temperature 1.0, {args.reps} reps (medians, order alternating), "
          f"native matmul {args.matmul}")
    for dname in args.dtypes:
        print(f"\n## weights {dname} (both sides)\n")
        print("| model | params | batch | generate tok/s (wall / CPU) | native tok/s (wall / CPU) "
              "| ratio wall | ratio CPU | target | roofline (native, CPU time) |")
        print("|---|---|---|---|---|---|---|---|---|")
        notes: list[str] = []
        for preset, batch in GRID:
            if preset not in args.models or (args.batches and batch not in args.batches):
                continue
            model, prompts = bench_case(preset, DTYPES[dname], batch, tok)
            engines = {"generate": make_engine("hf", model, tok),
                       "native": make_engine("native", model, tok, matmul=args.matmul)}
            if args.variant:  # a second native engine with other options, in the same alternation
                engines["variant"] = make_engine("native", model, tok, **parse_variant(args.variant))
            sides, ratio_wall, ratio_cpu = measure(engines, prompts, args.reps, args.new_tokens)
            g, n = sides["generate"], sides["native"]
            rw, rc = statistics.median(ratio_wall), statistics.median(ratio_cpu)
            target = TARGET[(preset, batch)]
            roof = roofline_hook(model.config, batch=batch, prompt_len=max(len(p) for p in prompts),
                                 new_tokens=args.new_tokens, dtype=dname, seconds=statistics.median(n.cpu_seconds))
            verdict = "ok" if rc >= target else "missed"
            if "variant" in sides:
                v = sides["variant"]
                paired = [a / b for a, b in zip(n.cpu, v.cpu)]
                notes.append(f"- {preset} b {batch}: variant ({args.variant}) {statistics.median(v.wall):,.0f} tok/s wall; "
                             f"native/variant on CPU time {statistics.median(paired):.2f}× "
                             f"(per rep: {', '.join(f'{x:.2f}' for x in paired)})")
            print(f"| {preset} | {count_parameters(model) / 1e6:.1f}M | {batch} "
                  f"| {statistics.median(g.wall):,.0f} / {statistics.median(g.cpu):,.0f} "
                  f"| {statistics.median(n.wall):,.0f} / {statistics.median(n.cpu):,.0f} "
                  f"| {rw:.2f}× | {rc:.2f}× (min {min(ratio_cpu):.2f}, max {max(ratio_cpu):.2f}) "
                  f"| ≥{target:.0f}× {verdict} | {roof} |", flush=True)
        if notes:
            print("\n" + "\n".join(notes), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is then one core's work)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per side (medians reported)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--models", nargs="+", default=["tiny-1m", "tiny-30m"])
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="only these batch sizes of the grid")
    ap.add_argument("--matmul", default="auto", help="the native engine's decode matmul form (auto, mm, mkl, dnn, mv)")
    ap.add_argument("--variant", default="", help="also time a native engine with these options, key=value,… "
                    "(e.g. compute=bf16), in the same alternation; prints native/variant")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
