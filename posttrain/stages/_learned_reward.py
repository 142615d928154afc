"""A trained reward model used by a later stage: where it is, which policy it was built for, and its
normalized score of each sampled reply (PPO's reward; rejection sampling's ranking).

The reward-model stage writes a sequence-classification checkpoint plus `reward_norm.json` (mean and
std of its scores on the start policy's samples, and that policy's path; `models.heads`). A stage that
follows it in a recipe starts from that folder, so it asks `resolve_policy` for the policy to load.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from posttrain.models.heads import (
    RewardNormalization,
    is_reward_model,
    last_token_scores,
    load_scalar_model,
)
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
