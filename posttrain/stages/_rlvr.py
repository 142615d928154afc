"""What the RLVR stages (`grpo`, `rejection_sampling`) share: problems, verifiers built from the recipe
(rule verifiers, the world's gold judge, a trained reward model), scoring a rollout, and the group
bookkeeping of group-relative methods.

Rows of a rollout are prompt-major (`Rollout.prompt_index`): the G samples of prompt i are rows
i·G … i·G + G − 1, which is the layout `posttrain.losses.grpo_advantages` expects.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posttrain.data import Problem, encode_prompt, read_jsonl
from posttrain.runtime.config import DataSource, RewardSpec
from posttrain.runtime.context import RunContext
from posttrain.rewards import (
    CombinedRewards,
    Scores,
    Skip,
    WeightedVerifier,
    build_verifier,
    combine,
)
from posttrain.rollout import Rollout
from posttrain.stages._learned_reward import RM_COLUMN, RewardModelVerifier
from posttrain.telemetry import costs
from posttrain.worlds.arithmetic import gold_reward

_INTEGER = re.compile(r"-?\d+")


# ---- problems ------------------------------------------------------------------------------------
def load_problems(ctx: RunContext, sources: Sequence[DataSource], *, levels: list[str] | None,
                  seed_offset: int = 0) -> list[Problem]:
    """Every source's problems, in order: a task's (never one of its eval problems; `levels` picks the
    task's levels) or a `problem` JSONL (read whole; `levels` does not filter a file)."""
    out: list[Problem] = []
    for i, src in enumerate(sources):
        if src.path is not None:
            out += read_jsonl(src.path, "problem").records
            continue
        out += ctx.tasks.get(src.task).records("problem", src.n, seed_offset=seed_offset + i, levels=levels)  # type: ignore[arg-type]
    if not out:
        raise ValueError("no problems: the stage's `data` sources are empty")
    return out


def encode_problems(problems: Sequence[Problem], tokenizer: Any, max_len: int) -> list[list[int]]:
    """Prompt ids with the chat template's generation prompt; an over-long prompt is an error naming it."""
    return [encode_prompt(p, tokenizer, max_len) for p in problems]


# ---- rewards -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Gold:
    value: int  # what `gold_reward` reads of a Fact


def world_gold(completions: list[str], *, answer: Sequence[str | None], **_: Any) -> Scores:
    """The arithmetic world's gold judge as a verifier: 0 wrong or off-format, 1 concise correct,
    down to 0.5 for a correct answer after rambling (`posttrain.worlds.arithmetic.gold_reward`).
    A gold answer that is not an integer cannot be judged (None, `unjudgeable`)."""
    values: list[float | None] = []
    reasons: list[Skip | None] = []
    for completion, gold in zip(completions, answer):
        if gold is None or not _INTEGER.fullmatch(str(gold).strip()):
            values.append(None)
            reasons.append(Skip.UNJUDGEABLE)
        else:
            values.append(gold_reward(_Gold(int(str(gold).strip())), completion))  # type: ignore[arg-type]
            reasons.append(None)
    return Scores(values, reasons)


def build_rewards(specs: Sequence[RewardSpec]) -> list[WeightedVerifier]:
    """The recipe's verifiers, built once per stage (close them with `close_rewards`). A `reward_model`
    reward is named here and loaded by `load_reward_models`, which needs the run."""
    out = []
    for spec in specs:
        if spec.name == "gold" and spec.params:
            raise ValueError(f"rewards: verifier 'gold' takes no params, got {sorted(spec.params)}")
        if spec.name == "reward_model":
            fn = RewardModelVerifier(spec.stage or "")
        else:
            fn = world_gold if spec.name == "gold" else build_verifier(spec.name, **spec.params)
        out.append(WeightedVerifier(spec.name, fn, spec.weight))
    return out


def load_reward_models(verifiers: Sequence[WeightedVerifier], ctx: RunContext, stage: str) -> None:
    """Load every `reward_model` reward among `verifiers` from the run (a finished reward_model stage or a
    folder), checked to read the run's vocabulary; an error names `stage` and the reward model."""
    for v in verifiers:
        if isinstance(v.verifier, RewardModelVerifier) and v.verifier.scorer is None:
            v.verifier.load(ctx, stage)


def reward_model_cost(verifiers: Sequence[WeightedVerifier], rows: int, seq_len: int) -> costs.Cost | None:
    """The score phase's FLOPs: the reward model's forward over `rows` sequences of `seq_len` tokens (None: none)."""
    rms = [v.verifier.scorer.model.config for v in verifiers
           if isinstance(v.verifier, RewardModelVerifier) and v.verifier.scorer is not None]
    return costs.forward(rms[0], batch=rows, seq_len=seq_len, logits="scalar") if rms else None


def close_rewards(verifiers: Sequence[WeightedVerifier]) -> None:
    for v in verifiers:
        close = getattr(v.verifier, "close", None)
        if close is not None:
            close()


def score_rollout(verifiers: Sequence[WeightedVerifier], rollout: Rollout, problems: Sequence[Problem]) -> CombinedRewards:
    """Score every row against its prompt's problem. Columns: `answer`, `tests`, `level`, `lengths`
    (completion tokens, EOS included)."""
    rows = rollout.prompt_index.tolist()
    extra: dict[str, list[Any]] = {}
    for v in verifiers:  # a reward model reads token ids: its forward runs here, its scores go in as a column
        if isinstance(v.verifier, RewardModelVerifier):
            if v.verifier.scorer is None:
                raise ValueError(f"reward_model {v.verifier.source!r} is not loaded (load_reward_models)")
            extra[RM_COLUMN] = v.verifier.scorer(rollout).tolist()
    return score_texts(verifiers, rollout.texts, [problems[i] for i in rows], rollout.completion_lengths.tolist(), **extra)


def score_texts(verifiers: Sequence[WeightedVerifier], texts: Sequence[str], problems: Sequence[Problem],
                lengths: Sequence[int], **extra: list[Any]) -> CombinedRewards:
    """Score texts[i] against problems[i] (one problem per text). Columns: `answer`, `tests`, `level`,
    `lengths` (the tokens the model wrote), and any `extra` (a reward model's scores, `score_rollout`)."""
    cols: dict[str, list[Any]] = {
        "answer": [p.answer for p in problems],
        "level": [p.level for p in problems],
        "lengths": list(lengths),
        **extra,
    }
    if any(p.tests is not None for p in problems):
        cols["tests"] = [p.tests for p in problems]
    return combine(verifiers, list(texts), **cols)


def passed(rewards: CombinedRewards, first: str, threshold: float) -> list[bool]:
    """Per row: the first listed verifier judged it and scored at least `threshold`."""
    return [v is not None and v >= threshold for v in rewards.per_verifier[first]]


# ---- groups --------------------------------------------------------------------------------------
@torch.no_grad()
def group_keep(total: Sequence[float | None], group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Which groups can carry a gradient. Shape: total (P·G,) → three (P,) bool tensors:
    (judged: every member has a reward, varied: judged and not all rewards equal, unjudged)."""
    if len(total) % group_size:
        raise ValueError(f"group_keep: {len(total)} rewards do not split into groups of {group_size}")
    missing = torch.tensor([t is None for t in total]).reshape(-1, group_size)        # (P, G)
    r = torch.tensor([0.0 if t is None else t for t in total]).reshape(-1, group_size)  # (P, G)
    judged = ~missing.any(1)
    varied = judged & ((r.amax(1) - r.amin(1)) > 1e-9)
    return judged, varied, ~judged
