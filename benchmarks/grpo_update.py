"""GRPO update forward + backward: the padded batch vs the shared-prompt layout, in one process.

    python benchmarks/grpo_update.py                          # the GRPO benchmark's shape: 2 prompts × G 8, 22 + 32 tokens
    python benchmarks/grpo_update.py --prompt-len 200 --reps 5
    python benchmarks/grpo_update.py --profile --threads 1 --reps 3   # op table: where the update's time goes

Same model (tiny-30m, random init), same tokens, bf16 autocast over fp32 weights (the `dtype: bf16`
recipes) or fp32 (`--fp32`), eager attention (what `attention: auto` picks on a CPU under bf16): the
teacher-forced log-probs of every completion token, summed, then backward. The two sides alternate
after warm-ups; the ratio per repetition is padded / shared on wall time, and the table shows medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.models import build_tiny
from posttrain.rollout.text import positions_from_mask
from posttrain.stages._packing import shared_prompt_logprobs


def batch(vocab: int, prompts: int, group: int, prompt_len: int, completion_len: int, seed: int = 0):
    """`prompts` × `group` rows: each group's prompt repeated, completions random, all full length."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(1, vocab, (prompts, prompt_len), generator=g).repeat_interleave(group, 0)
    c = torch.randint(1, vocab, (prompts * group, completion_len), generator=g)
    ids = torch.cat([p, c], 1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    return ids, mask, positions_from_mask(mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=22)
    ap.add_argument("--completion-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp32", action="store_true", help="no autocast (fp32 forward and backward)")
    ap.add_argument("--profile", action="store_true", help="instead: torch.profiler's op table of the shared-prompt "
                                                          "update with a fused AdamW step (where the update's time goes)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = build_tiny("tiny-30m", vocab_size=512, seed=0, max_seq_len=a.prompt_len + a.completion_len + 8, pad_token_id=0)
    model.config._attn_implementation = "eager"
    model.train()
    ids, mask, pos = batch(512, a.prompts, a.group, a.prompt_len, a.completion_len)
    p, n = a.prompt_len, a.completion_len
    targets = ids[:, p:]

    def run(shared: bool, keep_grads: bool = False) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not a.fp32):
            if shared:
                logps = shared_prompt_logprobs(model, ids, mask, pos, p)
            else:
                logits = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1],
                               logits_to_keep=n).logits  # as the stage's padded path: the last token is no input
                logps = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])
        logps.sum().backward()
        if not keep_grads:
            model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    if a.profile:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
        for _ in range(2):
            run(True)
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(a.reps):
                run(True, keep_grads=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        return
    for _ in range(2):
        run(False), run(True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(a.reps):
        for shared in ((False, True) if rep % 2 == 0 else (True, False)):
            times[shared].append(run(shared))
    ratios = [x / y for x, y in zip(times[False], times[True])]
    rows, seq = ids.shape
    print(f"# GRPO update forward+backward, tiny-30m, {'fp32' if a.fp32 else 'bf16 autocast'}, {a.threads} thread(s), "
          f"{a.prompts} prompts × G {a.group}, {p} prompt + {n} completion tokens, {a.reps} alternating reps")
    print("| layout | tokens through the matmuls | s (median) | per rep |")
    print("|---|---|---|---|")
    print(f"| padded | {rows} × {seq - 1} = {rows * (seq - 1):,} | {statistics.median(times[False]):.3f} | "
          f"{', '.join(f'{x:.3f}' for x in times[False])} |")
    print(f"| shared prompt | {a.prompts} × {p + a.group * (n - 1)} = {a.prompts * (p + a.group * (n - 1)):,} | "
          f"{statistics.median(times[True]):.3f} | {', '.join(f'{x:.3f}' for x in times[True])} |")
    print(f"\npadded / shared: **{statistics.median(ratios):.2f}×** (per rep {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
