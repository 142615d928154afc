"""Between-stage evaluations on the world's held-out problems — the "bisect" table.

The same evals run on every checkpoint of the pipeline, so a drop localizes to the stage that caused
it. Per level: **format** (the response ends its turn and has the expected shape — an optional
`<think>…</think>`, then text ending in one integer) and **exact match** of that integer, both under
greedy decoding; plus a **prose probe** of held-out single-digit facts ("7 plus 8 is" → 15), which
measures knowledge without asking for chat behaviour.
"""

from __future__ import annotations

import re
from dataclasses import asdict

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.data import encode_prompt
from posttrain.rewards import ProblemOutcome, pass_at_k_by_level
from posttrain.runtime.config import EvalConfig
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.greedy import PhaseFn, greedy
from posttrain.tasks.records import EvalRecord, binomial_stderr
from posttrain.worlds.arithmetic import ArithmeticWorld, parse_answer


def arithmetic_evals(model, tok, world: ArithmeticWorld, cfg: EvalConfig, *, stage: str, checkpoint: str,
                     phase: PhaseFn | None = None) -> list[EvalRecord]:
    out: list[EvalRecord] = []

    def rec(evalname: str, level: str | None, metric: str, hits: int, n: int) -> None:
        p = hits / n if n else float("nan")
        out.append(EvalRecord(stage, checkpoint, evalname, level, metric, p, n, binomial_stderr(p, n)))

    for level in cfg.levels:
        problems = world.eval_problems(level)[: cfg.per_level]
        prompts = [encode_prompt(p["prompt"], tok) for p in problems]
        texts, reasons = greedy(model, tok, prompts, cfg.max_new_tokens, cfg.batch_size, phase)
        answers = [parse_answer(t) if r == "stop" else None for t, r in zip(texts, reasons)]
        rec("arithmetic", level, "format", sum(a is not None for a in answers), len(problems))
        rec("arithmetic", level, "exact_match", sum(a == int(p["answer"]) for a, p in zip(answers, problems)), len(problems))

    probes = world.probe_prompts()
    ids = [tok(text, add_special_tokens=False)["input_ids"] for text, _ in probes]
    texts, _ = greedy(model, tok, ids, 4, cfg.batch_size, phase)
    first = [re.match(r"\s*(-?\d+)", t) for t in texts]
    rec("prose_probe", "L1", "exact_match", sum(bool(m) and int(m.group(1)) == v for m, (_, v) in zip(first, probes)), len(probes))
    return out


def as_json(records: list[EvalRecord]) -> list[dict]:
    return [asdict(r) for r in records]


@torch.no_grad()
def pass_at_k_evals(model: PreTrainedModel, tok: PreTrainedTokenizerBase, world: ArithmeticWorld, cfg: EvalConfig, *,
                    stage: str, checkpoint: str, samples: int = 8, ks: tuple[int, ...] = (1, 8),
                    temperature: float = 1.0, seed: int = 0) -> list[EvalRecord]:
    """pass@k per level (and pooled, level None) from `samples` sampled answers per held-out problem.

    The unbiased estimator of Chen et al. 2021 (`posttrain.rewards.pass_at_k`); a sample passes when it
    ends its turn and its final integer is the answer (the `exact_match` judge). Eval name
    `arithmetic@T<temperature>`, metric `pass@<k>`, `n` = problems, `stderr` across problems. Greedy
    pass@1 is the `exact_match` row of `arithmetic_evals`. Sampling is seeded: same checkpoint, same numbers.
    """
    if temperature <= 0:
        raise ValueError(f"pass_at_k_evals: temperature must be > 0 (greedy pass@1 is exact_match), got {temperature}")
    if not ks or any(not 1 <= k <= samples for k in ks):
        raise ValueError(f"pass_at_k_evals: every k must be in [1, samples={samples}], got {ks}")
    engine = make_engine("native", model, tok)
    was_training = model.training
    model.eval()
    outcomes: list[ProblemOutcome] = []
    per_call = max(1, cfg.batch_size // samples)  # prompts per generate call: batch_size rows
    for level in cfg.levels:
        problems = world.eval_problems(level)[: cfg.per_level]
        prompts = [encode_prompt(p["prompt"], tok) for p in problems]
        for i in range(0, len(prompts), per_call):
            params = SamplingParams(n=samples, temperature=temperature, max_new_tokens=cfg.max_new_tokens,
                                    seed=seed * 1_000_003 + i)
            r = engine.generate(prompts[i : i + per_call], params)
            for j, p in enumerate(problems[i : i + per_call]):
                rows = range(j * samples, (j + 1) * samples)
                c = sum(r.finish_reason[x] == "stop" and parse_answer(r.texts[x]) == int(p["answer"]) for x in rows)
                outcomes.append(ProblemOutcome(n=samples, c=c, level=level))
    model.train(was_training)
    name = f"arithmetic@T{temperature:g}"
    return [EvalRecord(stage, checkpoint, name, row.level, row.metric, row.value, row.n_problems, row.stderr)
            for row in pass_at_k_by_level(outcomes, ks)]
