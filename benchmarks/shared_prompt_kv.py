"""The n samples of a prompt reading its keys and values from one copy, against a copy in every row.

    python benchmarks/shared_prompt_kv.py                                  # the grid below
    python benchmarks/shared_prompt_kv.py --prompt-tokens 600 --new-tokens 128 --reps 9

GRPO samples G completions of each prompt. The native engine prefills a prompt once; where the C decode
attention runs, its G samples then read the prompt's keys and values from that one copy and write their
own tokens' into caches of their own (`NativeEngine(share_prompts=True)`, the default; `rollout/cpu/fused.py`
departure 12). The other way copies the prompt's keys and values into every sample's row
(`share_prompts=False`, what the engine does without the C attention). Both compute the same bits (the
script asserts equal tokens); what changes is the bytes a decode step reads and the cache the call holds.

Same engine, same model (tiny-30m from seed 0, bf16 weights, one thread), same prompts and seeds; the two
settings alternate order at every repetition after one warm-up each; medians of wall seconds per
`generate` call and of the paired ratios. No EOS ends a row (every row runs the whole budget), so the work
is the same at every repetition. Prompts are the benchmark corpus's lines, repeated to the length asked.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rollout import corpus  # benchmarks/rollout.py: the same corpus and tokenizer

from posttrain.models import build_tiny, train_tokenizer
from posttrain.rollout import NativeEngine, SamplingParams

GRID = [(16, 32), (16, 128), (600, 32), (600, 128)]  # (prompt tokens, new tokens)


def corpus_prompts(tok, count: int, length: int) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens, each from its own run of the corpus."""
    lines = corpus(4000, seed=1)
    out = []
    for i in range(count):
        ids: list[int] = []
        j = i * 997
        while len(ids) < length:
            ids += tok(lines[j % len(lines)])["input_ids"]
            j += 1
        out.append(ids[:length])
    return out


def measure(engine: NativeEngine, prompts: list[list[int]], params: SamplingParams, reps: int) -> dict:
    seconds: dict[bool, list[float]] = {True: [], False: []}
    kv: dict[bool, int] = {}
    tokens: dict[bool, torch.Tensor] = {}
    for rep in range(reps + 1):  # rep 0 warms up both settings
        for share in ((True, False) if rep % 2 == 0 else (False, True)):
            engine.share_prompts = share
            t = time.perf_counter()
            out = engine.generate(prompts, params)
            if rep:
                seconds[share].append(time.perf_counter() - t)
            kv[share], tokens[share] = engine.memory_bytes()["KV cache"], out.completion_ids
    if not torch.equal(tokens[True], tokens[False]):
        raise SystemExit("shared_prompt_kv: the two settings sampled different tokens (they must not)")
    paired = [b / a for a, b in zip(seconds[True], seconds[False])]
    return {"shared": statistics.median(seconds[True]), "copied": statistics.median(seconds[False]),
            "speedup": statistics.median(paired), "lo": min(paired), "hi": max(paired),
            "kv_shared": kv[True], "kv_copied": kv[False]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per call (GRPO's batch of groups)")
    ap.add_argument("--samples", type=int, default=8, help="samples of each prompt (GRPO's G)")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=None, help="instead of the grid's")
    ap.add_argument("--new-tokens", type=int, nargs="+", default=None, help="instead of the grid's")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = train_tokenizer(corpus(), vocab_size=512)
    model = build_tiny("tiny-30m", vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       seed=0).eval()
    engine = NativeEngine(model, tok, dtype=torch.bfloat16, eos_token_ids=[len(tok) + 1])  # no row ends early
    if not engine.step.gathers_rows(torch.device("cpu")):
        raise SystemExit("shared_prompt_kv: the C decode attention does not run here; nothing to compare")
    grid = GRID if args.prompt_tokens is None and args.new_tokens is None else \
        [(p, n) for p in (args.prompt_tokens or [16]) for n in (args.new_tokens or [128])]
    print(f"# tiny-30m, bf16 weights, {args.threads} thread(s), {args.prompts} prompts × {args.samples} samples, "
          f"temperature 1, {args.reps} reps (medians, order alternating)\n")
    print("| prompt tokens | new tokens | generate s, shared / copied | copied ÷ shared (min–max) "
          "| KV cache MiB, shared / copied |")
    print("|---|---|---|---|---|")
    for plen, new in grid:
        prompts = corpus_prompts(tok, args.prompts, plen)
        params = SamplingParams(n=args.samples, max_new_tokens=new, temperature=1.0, seed=0)
        r = measure(engine, prompts, params, args.reps)
        print(f"| {plen} | {new} | {r['shared']:.3f} / {r['copied']:.3f} | {r['speedup']:.2f}× "
              f"({r['lo']:.2f}–{r['hi']:.2f}) | {r['kv_shared'] / 2**20:.1f} / {r['kv_copied'] / 2**20:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
