"""The GRPO family's objectives: GRPO, DAPO and Dr. GRPO as rows of one table (`GRPO_VARIANTS`: advantage function,
aggregation, clip range), and the per-token loss each update reduces — the clipped surrogate plus the k3 KL
(DeepSeekMath eq. 3), or its off-policy form for asynchronous rollouts. References and departures: the
GRPO stage's module (`stages/grpo.py`) and docs/losses.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.losses._enum import StrEnum
from posttrain.losses.advantages import dr_grpo_advantages, grpo_advantages
from posttrain.losses.aggregation import Aggregation
from posttrain.losses.kl import kl_k3
from posttrain.losses.policy import OffPolicyStats, PolicyStats, decoupled_ppo_loss, ppo_clip_loss


class GRPOLoss(StrEnum):
    GRPO = "grpo"
    DAPO = "dapo"
    DR_GRPO = "dr_grpo"


@dataclass(frozen=True)
class LossVariant:
    advantages: Callable[..., Tensor]  # (rewards (N,), *, group_size) → (N,)
    aggregation: Aggregation
    clip_low: float
    clip_high: float


GRPO_VARIANTS: dict[GRPOLoss, LossVariant] = {
    GRPOLoss.GRPO: LossVariant(grpo_advantages, Aggregation.SEQ_MEAN_TOKEN_MEAN, 0.2, 0.2),
    GRPOLoss.DAPO: LossVariant(grpo_advantages, Aggregation.TOKEN_MEAN, 0.2, 0.28),
    GRPOLoss.DR_GRPO: LossVariant(dr_grpo_advantages, Aggregation.SEQ_MEAN_TOKEN_SUM_NORM, 0.2, 0.2),
}


def grpo_token_loss(logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None, advantages: Tensor,
                    mask: Tensor, *, clip_low: float, clip_high: float, kl_coef: float) -> tuple[Tensor, Tensor, PolicyStats]:
    """Per-token GRPO loss: clipped surrogate + kl_coef · k3(π ‖ π_ref) (DeepSeekMath eq. 3).

    Shape: logprobs, old_logprobs, ref_logprobs, mask (B, T); advantages (B,). Returns the loss (B, T)
    (0 outside the mask), the per-token k3 (B, T) (zeros without a reference) and the clip stats.
    """
    loss, stats = ppo_clip_loss(logprobs, old_logprobs, advantages[:, None], mask, clip_low=clip_low, clip_high=clip_high)
    if ref_logprobs is None:
        return loss, torch.zeros_like(loss), stats
    kl = torch.where(mask.bool(), kl_k3(logprobs, ref_logprobs), 0.0)
    return loss + kl_coef * kl, kl.detach(), stats


def decoupled_grpo_token_loss(logprobs: Tensor, prox_logprobs: Tensor, behav_logprobs: Tensor, ref_logprobs: Tensor | None,
                              advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float, kl_coef: float,
                              is_cap: float) -> tuple[Tensor, Tensor, PolicyStats, OffPolicyStats]:
    """`grpo_token_loss` with the off-policy correction (docs/async_rl.md): the clip against the proximal
    log-probs, each token's surrogate weighted by min(π_prox/π_behav, is_cap) (`losses.decoupled_ppo_loss`);
    the KL term is not weighted (it is a regularizer on π_θ, not an expectation over the behaviour policy).
    Shape: as `grpo_token_loss`, prox_logprobs and behav_logprobs (B, T). Also returns the weight stats."""
    loss, stats, is_stats = decoupled_ppo_loss(logprobs, prox_logprobs, behav_logprobs, advantages[:, None], mask,
                                               clip_low=clip_low, clip_high=clip_high, is_cap=is_cap)
    if ref_logprobs is None:
        return loss, torch.zeros_like(loss), stats, is_stats
    kl = torch.where(mask.bool(), kl_k3(logprobs, ref_logprobs), 0.0)
    return loss + kl_coef * kl, kl.detach(), stats, is_stats
