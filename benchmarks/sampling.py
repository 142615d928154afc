"""Per-step cost of drawing one token per row: the engine's sampler against two others, by vocabulary size.

    python benchmarks/sampling.py                     # vocab 512 … 151,936; 16 and 64 rows; 2 threads
    python benchmarks/sampling.py --threads 1 --reps 50

Temperature 1 (the sampling log-prob is the policy log-prob too), fp32 logits, ms per step (median
of `reps` steps after warm-up). Three ways to draw the same distribution:
- inversion — `posttrain.rollout.sampling.sample_into`: one uniform per row, cumulative sums, binary
  search, plus the two log-probs the engine returns; timed in both of its forms (softmax, and
  exp(z − max) with the log-prob from the total), of which the engine takes the first up to
  `sampling.SMALL_VOCAB` tokens and the second above;
- Gumbel-max — argmax(log q + G) with G = −log(−log U), a uniform per row *and vocabulary entry*
  (what the engine drew until it switched to inversion), plus the same log-probs;
- `torch.multinomial` on softmax probabilities, what `transformers` `generate` calls (no log-probs).
A real model's vocabulary (Qwen2: 151,936; Llama 3: 128,256) is where the noise of Gumbel-max costs
more than a small model's whole decode step. (The engine drew its Gumbel noise for many steps in one
call; this table draws it fresh each step, which at a few hundred tokens costs it some tens of µs.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.rollout import sampling
from posttrain.rollout.sampling import SamplingParams, draw_uniforms, sample_into

VOCABS = (314, 512, 4_096, 32_000, 128_256, 151_936)


def gumbel_max(logits: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: Gumbel-max with fresh noise for every vocabulary entry."""
    logq = logits.log_softmax(-1)
    noise = torch.rand(logits.shape, generator=gen).log_().neg_().log_().neg_()
    tokens = (logq + noise).argmax(-1)
    return tokens, logq.gather(-1, tokens[:, None])[:, 0]


def per_step_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", nargs="+", type=int, default=[8, 16, 64])
    ap.add_argument("--vocabs", nargs="+", type=int, default=list(VOCABS))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    params = SamplingParams(temperature=1.0)
    print(f"# sampling one token per row, temperature 1, fp32 logits, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), median of {a.reps} steps")
    print(f"| rows | vocab | inversion, softmax form ms | inversion, exp form ms | Gumbel-max ms "
          f"| torch.multinomial ms | Gumbel / inversion (the form used, ≤ {sampling.SMALL_VOCAB:,}: softmax) |")
    print("|---|---|---|---|---|---|---|")
    chosen = sampling.SMALL_VOCAB
    for rows in a.rows:
        for vocab in a.vocabs:
            gen = torch.Generator().manual_seed(0)
            logits = torch.randn(rows, vocab, generator=gen) * 3
            tokens, lp, plp = torch.empty(rows, dtype=torch.long), torch.empty(rows), torch.empty(rows)
            forms = {}
            for name, limit in (("softmax", 10**9), ("exp", 0)):
                sampling.SMALL_VOCAB = limit
                forms[name] = per_step_ms(lambda: sample_into(logits, params, draw_uniforms(1, rows, gen, logits.device)[0],
                                                              tokens, lp, plp), a.reps)
            sampling.SMALL_VOCAB = chosen
            ours = forms["softmax" if vocab <= chosen else "exp"]
            gumbel = per_step_ms(lambda: gumbel_max(logits, gen), a.reps)
            multinomial = per_step_ms(lambda: torch.multinomial(logits.softmax(-1), 1, generator=gen), a.reps)
            print(f"| {rows} | {vocab:,} | {forms['softmax']:.3f} | {forms['exp']:.3f} | {gumbel:.3f} | {multinomial:.3f} "
                  f"| {gumbel / ours:.1f}× |", flush=True)


if __name__ == "__main__":
    main()
