"""Agreement of an AI judge with the arithmetic world's gold judge (issue 25).

    python benchmarks/judge_agreement.py [--pairs 40] [--levels L1 L2] [--seed 0] [--batch-size 8] [--rubric [--rubric-tokens 32]] [--checkpoint DIR]

Pairs: for each training problem of the world (held-out eval problems are never used), the gold-best
reply (`concise_answer`: column work, then the number) against a worse one — a wrong number after the
same work (`correctness`, even pairs) or the right number after filler text (`style`, odd pairs: gold
0.5–0.8 vs 1.0) — shown in a seeded random order. The judge (default SmolLM2-135M-Instruct, greedy, one
torch thread) judges each pair in both orders; `pairwise_gold_agreement` compares with
`task.gold_rewards`. Prints the agreement per kind and overall with standard errors, how often order 1
answered A, and the wall time. With `--rubric`, the rubric judge also scores every reply on its own
(1–10) and the higher score is its pick (`pairs_from_scores`), measured the same way.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from posttrain.judges import LocalChatBackend, gold_agreement, judge_scores, pairs_from_scores, pairwise_gold_agreement
from posttrain.models import smollm2_135m_instruct
from posttrain.tasks.arithmetic import ArithmeticTask, fact_of
from posttrain.worlds.arithmetic import concise_answer, ramble, wrong_answer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--levels", nargs="+", default=["L1", "L2"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rubric", action="store_true", help="also score each reply with the rubric judge")
    ap.add_argument("--rubric-tokens", type=int, default=32, help="reply budget of the rubric judge")
    ap.add_argument("--checkpoint", default=None, help="judge checkpoint (default: SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    task = ArithmeticTask(seed=args.seed)
    problems = task.records("problem", args.pairs, levels=args.levels, seed_offset=25)
    rng = random.Random(args.seed)
    firsts, seconds, kinds = [], [], []
    for i, p in enumerate(problems):
        f = fact_of(p)
        good = concise_answer(f)
        bad, kind = (wrong_answer(f, rng), "correctness") if i % 2 == 0 else (ramble(f, rng), "style")
        x, y = (good, bad) if rng.random() < 0.5 else (bad, good)
        firsts.append(x)
        seconds.append(y)
        kinds.append(kind)

    backend = LocalChatBackend.from_checkpoint(args.checkpoint or smollm2_135m_instruct(), batch_size=args.batch_size)
    t0 = time.perf_counter()
    overall, judgements = pairwise_gold_agreement(backend, problems, firsts, seconds, task.gold_rewards)
    wall = time.perf_counter() - t0
    stop = ["stop"] * len(problems)
    g1, g2 = task.gold_rewards(problems, firsts, stop), task.gold_rewards(problems, seconds, stop)
    print(f"judge: {args.checkpoint or 'SmolLM2-135M-Instruct'}, {len(problems)} pairs ({', '.join(args.levels)}), "
          f"{2 * len(problems)} judge calls, {wall:.0f} s wall")
    print(f"overall: {overall.summary()}")
    for kind in ("correctness", "style"):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        a = gold_agreement([judgements[i] for i in idx], [g1[i] for i in idx], [g2[i] for i in idx])
        print(f"{kind}: {a.summary()}")
    c1 = [j.choices[0] for j in judgements]
    c2 = [j.choices[1] for j in judgements]
    print(f"order 1 answered A {c1.count('A')}, B {c1.count('B')}, unparseable {c1.count(None)}; "
          f"order 2 answered A {c2.count('A')}, B {c2.count('B')}, unparseable {c2.count(None)}")
    print("first replies:", [j.replies[0][:40] for j in judgements[:4]])

    if args.rubric:  # the same pairs, each reply scored on its own (no position to be biased by)
        t0 = time.perf_counter()
        prompts = [p.prompt for p in problems]
        r1, r2 = (judge_scores(backend, prompts, texts, max_tokens=args.rubric_tokens) for texts in (firsts, seconds))
        wall = time.perf_counter() - t0
        scored = pairs_from_scores(r1.scores, r2.scores)
        print(f"rubric judge ({2 * len(problems)} calls, {wall:.0f} s wall): {gold_agreement(scored, g1, g2).summary()}")
        for kind in ("correctness", "style"):
            idx = [i for i, k in enumerate(kinds) if k == kind]
            a = gold_agreement([scored[i] for i in idx], [g1[i] for i in idx], [g2[i] for i in idx])
            print(f"rubric {kind}: {a.summary()}")
        print(f"rubric unparseable {r1.unparseable + r2.unparseable} of {2 * len(problems)}; "
              f"scores seen {sorted({s for s in r1.scores + r2.scores if s is not None})}; "
              f"first replies: {[t[-60:] for t in r1.replies[:3]]}")


if __name__ == "__main__":
    main()
