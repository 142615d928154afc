"""Between-stage evaluations on the world's held-out problems — the "bisect" table.

The same evals run on every checkpoint of the pipeline, so a drop localizes to the stage that caused
it. Per level: **format** (the response ends its turn and has the expected shape — an optional
`<think>…</think>`, then text ending in one integer) and **exact match** of that integer, both under
greedy decoding; plus a **prose probe** of held-out single-digit facts ("7 plus 8 is" → 15), which
measures knowledge without asking for chat behaviour.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.data import encode_prompt
from posttrain.pipeline.config import EvalConfig
from posttrain.rollout import SamplingParams, make_engine
from posttrain.worlds.arithmetic import LEVELS, ArithmeticWorld, parse_answer


@dataclass(frozen=True)
class EvalRecord:
    stage: str
    checkpoint: str
    eval: str
    level: str | None
    metric: str
    value: float
    n: int
    stderr: float | None


def _binomial_stderr(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


@torch.no_grad()
def greedy(model: PreTrainedModel, tok: PreTrainedTokenizerBase, prompts: list[list[int]], max_new: int, batch: int):
    """Greedy completions (texts, finish reasons) through the native rollout engine."""
    engine = make_engine("native", model, tok)
    texts, reasons = [], []
    was_training = model.training
    model.eval()
    for i in range(0, len(prompts), batch):
        r = engine.generate(prompts[i : i + batch], SamplingParams(temperature=0.0, max_new_tokens=max_new))
        texts += r.texts
        reasons += r.finish_reason
    model.train(was_training)
    return texts, reasons


def arithmetic_evals(model, tok, world: ArithmeticWorld, cfg: EvalConfig, *, stage: str, checkpoint: str) -> list[EvalRecord]:
    out: list[EvalRecord] = []

    def rec(evalname: str, level: str | None, metric: str, hits: int, n: int) -> None:
        p = hits / n if n else float("nan")
        out.append(EvalRecord(stage, checkpoint, evalname, level, metric, p, n, _binomial_stderr(p, n)))

    for level in cfg.levels:
        problems = world.eval_problems(level)[: cfg.per_level]
        prompts = [encode_prompt(p["prompt"], tok) for p in problems]
        texts, reasons = greedy(model, tok, prompts, cfg.max_new_tokens, cfg.batch_size)
        answers = [parse_answer(t) if r == "stop" else None for t, r in zip(texts, reasons)]
        rec("arithmetic", level, "format", sum(a is not None for a in answers), len(problems))
        rec("arithmetic", level, "exact_match", sum(a == int(p["answer"]) for a, p in zip(answers, problems)), len(problems))

    probes = world.probe_prompts()
    ids = [tok(text, add_special_tokens=False)["input_ids"] for text, _ in probes]
    texts, _ = greedy(model, tok, ids, 4, cfg.batch_size)
    first = [re.match(r"\s*(-?\d+)", t) for t in texts]
    rec("prose_probe", "L1", "exact_match", sum(bool(m) and int(m.group(1)) == v for m, (_, v) in zip(first, probes)), len(probes))
    return out


def as_json(records: list[EvalRecord]) -> list[dict]:
    return [asdict(r) for r in records]


def level_name(level: str | None) -> str:
    return f"{level} {LEVELS[level]}" if level in LEVELS else str(level)
