"""A trained reward model used by a later stage: where it is, which policy it was built for, and its
normalized score of each sampled reply (PPO's reward; rejection sampling's ranking; one of GRPO's
rewards, `RewardModelVerifier`).

The reward-model stage writes a sequence-classification checkpoint plus `reward_norm.json` (mean and
std of its scores on the start policy's samples, and that policy's path; `models.heads`). A stage that
follows it in a recipe starts from that folder, so it asks `resolve_policy` for the policy to load.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.models.heads import (
    RewardNormalization,
    is_reward_model,
    last_token_scores,
    load_scalar_model,
)
from posttrain.models import load_tokenizer
from posttrain.rewards import Scores, VerifierInputError
from posttrain.runtime.checkpoint import final_checkpoint
from posttrain.runtime.context import RunContext
from posttrain.rollout import Rollout


def resolve_reward_model(ctx: RunContext, name: str, stage: str) -> Path:
    """The reward model `name`: a finished reward_model stage of this run, or a path to a reward-model
    folder. `stage` names the asking stage in the error."""
    in_run = final_checkpoint(ctx.stage_dir(name))
    path = in_run or Path(name)
    if not is_reward_model(path):
        raise ValueError(f"{stage}: reward_model {name!r} is neither a finished reward_model stage of "
                         f"this run ({ctx.stage_dir(name)}/final) nor a reward-model folder with reward_norm.json")
    return path


def resolve_policy(ctx: RunContext, norm: RewardNormalization | None = None) -> Path:
    """The policy to start from: ctx.start — unless the pipeline handed over a reward model (its resume
    path after a finished reward_model stage), whose reward_norm.json (or `norm`) names the policy it
    was built for."""
    if not is_reward_model(ctx.start):
        return ctx.start
    policy = Path((norm or RewardNormalization.load(ctx.start)).policy)
    return policy if policy.is_absolute() else ctx.run_dir / policy


class RewardModelScorer:
    """`scorer(rollout)` → each row's normalized reward-model score at its last token. Shape: (R,) fp32.

    batch_rows: rows per forward (None: the whole rollout in one)."""

    def __init__(self, path: Path, device: torch.device, batch_rows: int | None = 64):
        self.path, self.batch_rows = path, batch_rows
        self.norm = RewardNormalization.load(path)
        self.model = load_scalar_model(path, device=device).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, r: Rollout) -> Tensor:
        b = self.batch_rows or len(r)
        return torch.cat([self.norm.apply(last_token_scores(self.model, r.sequence_ids[i : i + b],
                                                             r.sequence_mask[i : i + b], r.position_ids[i : i + b]))
                          for i in range(0, len(r), b)])


# The column `score_rollout` fills with the reward model's scores, which `RewardModelVerifier` reads.
RM_COLUMN = "reward_model_scores"


def check_vocabulary(path: Path, tokenizer: Any, stage: str, name: str) -> None:
    """The reward model at `path` reads the run's token ids: the same vocabulary as `tokenizer` (its own
    tokenizer, when the folder has one; else an embedding table that holds every id), or an error naming
    the stage and the reward model (scoring another vocabulary's ids is silent garbage)."""
    ours = tokenizer.get_vocab()
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        theirs = load_tokenizer(path).get_vocab()
        if theirs == ours:
            return
        what = f"another vocabulary ({len(theirs):,} tokens)"
    else:
        size = int(json.loads((path / "config.json").read_text()).get("vocab_size", 0))
        if size >= len(ours):
            return
        what = f"an embedding table of {size:,} ids (no tokenizer saved beside it)"
    raise ValueError(f"{stage}: reward_model {name!r} ({path}) was trained with {what}, not the run's tokenizer "
                     f"({len(ours):,} tokens); it cannot score this policy's token ids — train the reward model "
                     "in this run, on this tokenizer")


class RewardModelVerifier:
    """A reward model behind the verifier contract (posttrain.rewards.base), so `rewards.combine` sums it
    with the rule rewards and logs it as `reward/<name>`: each row's normalized score at its last token.

    Built from the recipe by name (`source`: a reward_model stage or a folder) and loaded into the run by
    `_rlvr.load_reward_models` (`self.scorer`). The scores need token ids, which a verifier never sees:
    `_rlvr.score_rollout` runs the scorer on the rollout (its forward is the `score` phase's cost) and
    passes the result as the `RM_COLUMN` column, which this reads back. Texts alone (a multi-turn
    episode, `score_texts`) are an error."""

    def __init__(self, source: str):
        self.source = source
        self.scorer: RewardModelScorer | None = None

    def load(self, ctx: RunContext, stage: str) -> None:
        """Resolve `source` in the run, check it reads the run's vocabulary, load it on `ctx.device`."""
        path = resolve_reward_model(ctx, self.source, stage)
        check_vocabulary(path, ctx.tokenizer, stage, self.source)
        self.scorer = RewardModelScorer(path, ctx.device)

    def __call__(self, completions: list[str], /, **columns: Any) -> Scores:
        scores: Sequence[float] | None = columns.get(RM_COLUMN)
        if scores is None:
            raise VerifierInputError(f"reward_model {self.source!r}: scores token ids, and this batch came as text "
                                     "only (episodes in an `env`); use rule verifiers there")
        if len(scores) != len(completions):
            raise VerifierInputError(f"reward_model: {len(scores)} scores for {len(completions)} completions")
        return Scores([float(s) for s in scores])
