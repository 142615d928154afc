"""The `arithmetic` task: the built-in world (posttrain.worlds.arithmetic) behind the Task protocol.

It supplies everything but an environment (its answers are single turns): SFT demonstrations, gold-ranked pairs, unpaired examples and rankings,
problems for RL, held-out evals per level (L1–L4) with format and exact-match metrics, the prose
probe, the gold judge, the pretraining stream and the texts a from-scratch tokenizer is trained on.
The world is built on first use, so naming the task costs nothing until a stage asks for data.

Eval rows are the ones the pipeline has always written: eval `arithmetic`, metrics `format` and
`exact_match` per level (greedy); eval `prose_probe` (L1, exact_match); sampled pass@k as
`arithmetic@T<t>` — so runs before and after the Task layer compare line for line.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any

from posttrain.data import encode_prompt, parse_record
from posttrain.data.records import Problem, Record
from posttrain.rollout.greedy import greedy
from posttrain.tasks.base import Capability, EvalRequest, PhaseFn, Task, TaskError
from posttrain.tasks.evaluate import eval_sets, rate, sampled_pass_at_k
from posttrain.tasks.records import EvalRecord
from posttrain.worlds.arithmetic import (
    LEVELS,
    ArithmeticWorld,
    Fact,
    concise_answer,
    gold_reward,
    parse_answer,
    question,
    ramble,
    wrong_answer,
)


def world_rankings(world: ArithmeticWorld, n: int, *, seed_offset: int = 0) -> list[dict]:
    """`n` ranking rows {prompt, responses (best first), level, answer} ordered by the gold judge:
    a concise correct answer (gold 1.0) ≻ the same answer after a ramble (0.5–0.8) ≻ a wrong one (0)."""
    rng = random.Random(f"{world.seed}-ranking-{seed_offset}")
    rows = []
    for _ in range(n):
        f = world.train_fact(rng)
        rows.append({"prompt": question(f, rng), "responses": [concise_answer(f), ramble(f, rng), wrong_answer(f, rng)],
                     "level": f.level, "answer": str(f.value)})
    return rows


def world_rows(world: ArithmeticWorld, kind: str, n: int, seed_offset: int) -> list[dict]:
    """Rows of a record kind in the JSONL schemas (docs/data.md)."""
    if kind == "sft":
        return [{"messages": m} for m in world.sft_split(n, seed_offset=seed_offset)]
    if kind == "preference":
        return world.preference_split(n, seed_offset=seed_offset)
    if kind == "ranking":
        return world_rankings(world, n, seed_offset=seed_offset)
    if kind == "unpaired":  # each world pair gives a desirable and an undesirable example
        rows = []
        for p in world.preference_split((n + 1) // 2, seed_offset=seed_offset):
            meta = {k: v for k, v in p.items() if k not in ("prompt", "chosen", "rejected")}
            rows += [{"prompt": p["prompt"], "completion": p["chosen"], "label": True, **meta},
                     {"prompt": p["prompt"], "completion": p["rejected"], "label": False, **meta}]
        return rows[:n]
    raise ValueError(f"the arithmetic world has no {kind!r} split")


def as_problem(row: dict, origin: str = "") -> Problem:
    return Problem(prompt=row["prompt"], answer=row["answer"], level=row["level"],
                   meta={k: row[k] for k in ("a", "op", "b")}, origin=origin)


def fact_of(problem: Problem) -> Fact | None:
    """The problem behind a row carrying a, op, b in its meta (world rows, or a file with them); else None."""
    try:
        return Fact(int(problem.meta["a"]), str(problem.meta["op"]), int(problem.meta["b"]))
    except (KeyError, TypeError, ValueError):
        return None


class ArithmeticTask(Task):
    name = "arithmetic"
    capabilities = frozenset(Capability) - {Capability.ENV}  # every one but an environment (single-turn answers)
    levels = tuple(LEVELS)

    def __init__(self, *, seed: int = 0, eval_per_level: int = ArithmeticWorld.eval_per_level,
                 world: ArithmeticWorld | None = None):
        self._seed, self._eval_per_level, self._given = seed, eval_per_level, world

    @cached_property
    def world(self) -> ArithmeticWorld:
        """Built on first use. It holds out at least `eval_per_level` problems per level (more where a
        recipe's eval asks for more and the level has them), and every training split excludes them."""
        if self._given is not None:
            return self._given
        return ArithmeticWorld(seed=self._seed, eval_per_level=max(ArithmeticWorld.eval_per_level, self._eval_per_level))

    # ---- data ------------------------------------------------------------------------------------
    def _records(self, kind: str, n: int, *, seed_offset: int, levels: Sequence[str] | None) -> list[Record]:
        if kind == "problem":
            rows = self.world.problems(n, levels=list(levels) if levels else None, seed_offset=seed_offset)
            return [as_problem(r, f"world[{j}]") for j, r in enumerate(rows)]
        return [parse_record(r, kind, where=f"world[{i}]") for i, r in enumerate(world_rows(self.world, kind, n, seed_offset))]

    def pretrain_documents(self, n: int, *, seed_offset: int = 0) -> Iterator[str]:
        return self.world.pretrain_documents(n, seed_offset=seed_offset)

    def tokenizer_texts(self) -> list[str]:
        """The world's pretraining prose and chat turns (as a real tokenizer sees broad text)."""
        texts = list(self.world.pretrain_documents(5000, seed_offset=99))
        texts += [f"user\n{ex[0]['content']}\nassistant\n{ex[1]['content']}" for ex in self.world.sft_split(2000, seed_offset=99)]
        return texts

    # ---- judges ----------------------------------------------------------------------------------
    def eval_problems(self, level: str | None) -> list[Problem]:
        if level not in LEVELS:
            raise TaskError(f"task 'arithmetic': unknown level {level!r}; expected one of {list(LEVELS)}")
        # One fixed phrasing per problem, so a checkpoint's score moves only with the checkpoint.
        return [as_problem(r, f"eval[{level}][{i}]") for i, r in enumerate(self.world.eval_problems(level))]

    def judge(self, problems: Sequence[Problem], texts: Sequence[str], finish: Sequence[str]) -> list[bool]:
        """Exact match: the reply ended its turn and its final integer is the answer."""
        return [r == "stop" and parse_answer(t) == int(str(p.answer)) for p, t, r in zip(problems, texts, finish)]

    def gold_rewards(self, problems: Sequence[Problem], texts: Sequence[str], finish: Sequence[str]) -> list[float | None]:
        """Gold reward per reply; None where the problem is unknown; 0 for a reply that never ended."""
        facts = [fact_of(p) for p in problems]
        return [None if f is None else (gold_reward(f, t) if r == "stop" else 0.0) for f, t, r in zip(facts, texts, finish)]

    def probe_prompts(self) -> list[tuple[str, int]]:
        return self.world.probe_prompts()

    # ---- the eval --------------------------------------------------------------------------------
    def evaluate(self, model: Any, tok: Any, request: EvalRequest, *, stage: str, checkpoint: str,
                 phase: PhaseFn | None = None) -> list[EvalRecord]:
        """Per level: **format** (the reply ends its turn and has the expected shape — an optional
        `<think>…</think>`, then text ending in one integer) and **exact match** under greedy decoding;
        the **prose probe** of held-out single-digit facts ("7 plus 8 is" → 15), which measures
        knowledge without asking for chat behaviour; sampled pass@k when `k` is given."""
        sets = eval_sets(self, request)
        out: list[EvalRecord] = []
        if request.greedy:
            for level, problems in sets.items():
                prompts = [encode_prompt(p.prompt, tok) for p in problems]
                texts, reasons = greedy(model, tok, prompts, request.max_new_tokens, request.batch_size, phase)
                answers = [parse_answer(t) if r == "stop" else None for t, r in zip(texts, reasons)]
                out.append(rate(stage, checkpoint, "arithmetic", level, "format", sum(a is not None for a in answers), len(problems)))
                out.append(rate(stage, checkpoint, "arithmetic", level, "exact_match",
                                sum(a == int(str(p.answer)) for a, p in zip(answers, problems)), len(problems)))
        if request.probe:
            probes = self.probe_prompts()
            ids = [tok(text, add_special_tokens=False)["input_ids"] for text, _ in probes]
            texts, _ = greedy(model, tok, ids, 4, request.batch_size, phase)
            first = [re.match(r"\s*(-?\d+)", t) for t in texts]
            out.append(rate(stage, checkpoint, "prose_probe", "L1", "exact_match",
                            sum(bool(m) and int(m.group(1)) == v for m, (_, v) in zip(first, probes)), len(probes)))
        if request.k:
            out += sampled_pass_at_k(self, model, tok, request, sets, stage=stage, checkpoint=checkpoint)
        return out
