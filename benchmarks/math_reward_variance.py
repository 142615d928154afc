"""Does the `math` reward give GRPO a gradient on a real chat model? Reward variance per sampled group.

    python benchmarks/math_reward_variance.py                  # 32 groups of 8, T = 1, 24 new tokens, the base model
    python benchmarks/math_reward_variance.py --groups 64 --seed 1
    python benchmarks/math_reward_variance.py --max-new-tokens 96 --temperature 0.7
    python benchmarks/math_reward_variance.py --init runs/smollm2/checkpoints/dpo/final   # what GRPO starts from
    python benchmarks/math_reward_variance.py --problems recipes/data/smollm2/problems.jsonl --group-size 4

1. A user's problem file: `--groups` two-digit additions, prompt "Compute A + B. Reply with the number
   only.", written as JSONL in our `problem` schema and read back with `read_jsonl(…, "problem")`
   (the path a recipe's `data: [{path: …}]` takes) — or the first `--groups` problems of the file
   given as `--problems` (e.g. the GRPO file of `recipes/smollm2-own-data.yaml`).
2. SmolLM2-135M-Instruct (`posttrain.models.smollm2_135m_instruct()`), or any checkpoint folder given
   as `--init` (e.g. the SFT or DPO stage of `recipes/smollm2-own-data.yaml`: the policy its GRPO stage
   starts from), prompts through its chat template, G = 8 samples per prompt at `--temperature` (1)
   with `--max-new-tokens` (24) through our rollout engine (native backend).
3. Each completion scored by `build_verifier("math")` — what a GRPO stage's `rewards: [{name: math}]`
   builds. GRPO's advantage is zero in a group whose rewards are all equal, so the number that
   matters is the fraction of groups with non-zero reward variance. Beside it, the same completions
   under the strict one-answer grammar (`format.final_answer`, integer compare): what the `math`
   verifier paid before issue 21.

Prints the fraction of groups with variance > 0 under both, the mean reward (= per-sample accuracy),
the share of samples cut by the token budget (finish reason "length"), and a few completions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from posttrain.data import encode_prompt, read_jsonl
from posttrain.models import load_model, load_tokenizer, smollm2_135m_instruct
from posttrain.rewards import build_verifier, final_answer
from posttrain.rollout import SamplingParams, make_engine

PROMPT = "Compute {a} + {b}. Reply with the number only."


def write_problems(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b)}) + "\n")


def strict(texts: list[str], golds: list[str]) -> list[float]:
    """The pre-issue-21 accuracy: one bare answer after the reasoning, compared as an integer."""
    out = []
    for text, gold in zip(texts, golds):
        ans = final_answer(text)
        out.append(1.0 if ans is not None and ans.replace(",", "").lstrip("+").isdigit()
                   and int(ans.replace(",", "")) == int(gold) else 0.0)
    return out


def fraction_with_variance(scores: list[float | None], group: int) -> tuple[float, int]:
    groups = [scores[i:i + group] for i in range(0, len(scores), group)]
    varied = sum(1 for g in groups if len({s for s in g if s is not None}) > 1)
    return varied / len(groups), len(groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24, help="answer budget per sample")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--problems", type=Path, default=None,
                    help="a `problem` JSONL file to take the first --groups problems from (default: random additions)")
    ap.add_argument("--init", type=Path, default=None,
                    help="checkpoint folder to sample from (default: the base SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, default=4, help="prompts per generate call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dump", type=Path, default=None, help="write every completion and its scores (JSONL)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.problems is not None:
        problems, report = read_jsonl(args.problems, "problem")
        problems = problems[: args.groups]
        print(report.summary(), f"— the first {len(problems)}")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "problems.jsonl"
            write_problems(path, args.groups, args.seed)
            problems, report = read_jsonl(path, "problem")
        print(report.summary().replace(str(path), "problems.jsonl"))

    folder = args.init or smollm2_135m_instruct()
    model, tok = load_model(folder), load_tokenizer(folder)
    engine = make_engine("native", model, tok)
    prompts = [encode_prompt(p, tok) for p in problems]
    params = SamplingParams(n=args.group_size, temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
    start = time.perf_counter()
    texts: list[str] = []
    finish: list[str] = []
    golds: list[str] = []
    for lo in range(0, len(prompts), args.batch):  # a few prompts at a time: bounded memory, progress
        chunk = engine.generate(prompts[lo:lo + args.batch], params)
        texts += chunk.texts
        finish += chunk.finish_reason
        golds += [problems[lo + int(i)].answer for i in chunk.prompt_index]
        print(f"  generated groups {lo + 1}–{min(lo + args.batch, len(prompts))} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    gen_s = time.perf_counter() - start

    verifier = build_verifier("math")
    try:
        start = time.perf_counter()
        scores = verifier(texts, answer=golds)
        score_s = time.perf_counter() - start
    finally:
        verifier.close()
    old = strict(texts, golds)

    frac, n_groups = fraction_with_variance(list(scores), args.group_size)
    frac_old, _ = fraction_with_variance(old, args.group_size)
    judged = [s for s in scores if s is not None]
    cut = sum(f == "length" for f in finish)
    print(f"{'SmolLM2-135M-Instruct' if args.init is None else args.init}, {n_groups} groups × G={args.group_size}, "
          f"temperature {args.temperature:g}, "
          f"max_new_tokens {args.max_new_tokens}, seed {args.seed}")
    print(f"generate {gen_s:.1f} s, score {score_s:.2f} s ({len(scores)} completions; "
          f"{verifier.counters['in_process']} in-process, {verifier.counters['pooled']} through math-verify)")
    print(f"math reward:   mean {statistics.fmean(judged):.3f} (= per-sample accuracy), skipped {len(scores) - len(judged)}, "
          f"groups with non-zero variance {frac:.3f} ({round(frac * n_groups)}/{n_groups})")
    print(f"strict (old):  mean {statistics.fmean(old):.3f}, "
          f"groups with non-zero variance {frac_old:.3f} ({round(frac_old * n_groups)}/{n_groups})")
    print(f"finish reasons: {dict(Counter(finish))}; cut by the budget {cut}/{len(finish)} = {cut / len(finish):.3f}")
    if args.dump is not None:
        with args.dump.open("w", encoding="utf-8") as f:
            for j, (text, gold, s, o) in enumerate(zip(texts, golds, scores, old)):
                f.write(json.dumps({"group": j // args.group_size, "gold": gold, "text": text,
                                    "math": s, "strict": o}) + "\n")
    print("first completions of group 0 (gold " + golds[0] + "):")
    for text, s, o in list(zip(texts, scores, old))[: args.group_size]:
        print(f"  math={s} strict={o}  {text[:70]!r}")


if __name__ == "__main__":
    main()
