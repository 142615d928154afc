"""Reward-model objective: the Bradley–Terry pairwise loss, and rankings expanded into weighted pairs.

Reference: InstructGPT (Ouyang et al. 2022), eq. 1:
    loss(θ) = −1/C(K,2) · E_{(x, y_w, y_l)} [ log σ(r_θ(x, y_w) − r_θ(x, y_l)) ],
over all C(K,2) = K(K−1)/2 pairs of one ranking of K responses, so that each ranking counts once
however many responses it ranks. The optional margin is Llama 2's (Touvron et al. 2023, eq. 2):
    −log σ(r_w − r_l − m(r)).

Departures:
1. The weighting is explicit: `rankings_to_pairs` gives each pair weight 1/C(K,2), and
   `bradley_terry_loss` returns Σ_p w_p ℓ_p / normalizer, with normalizer = Σ w (= number of
   rankings) unless the caller passes the full optimizer batch's count for gradient accumulation.
2. Ties are not expanded: a ranking is a strict order of response indices, best first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.losses._masked import check_ndim, check_positive, check_same_shape
from posttrain.losses._stats import Stats


@dataclass(frozen=True)
class RewardStats(Stats):
    accuracy: Tensor  # weighted share of pairs with r_chosen > r_rejected
    margin: Tensor  # weighted mean of r_chosen − r_rejected
    chosen_reward: Tensor  # weighted mean r_chosen
    rejected_reward: Tensor  # weighted mean r_rejected


def bradley_terry_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    *,
    margin: Tensor | float | None = None,
    weights: Tensor | None = None,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, RewardStats]:
    """Σ_p w_p · −log σ(r_chosen_p − r_rejected_p − m_p) / normalizer.

    Shape: chosen_rewards, rejected_rewards (P,) scalar rewards of each pair; margin (P,) or a float
    (Llama 2's margin; None = 0); weights (P,) (None = 1 each; from `rankings_to_pairs` for rankings).
    normalizer: None = Σ weights of this call; for gradient accumulation pass Σ weights of the whole
    optimizer batch.
    """
    where = "bradley_terry_loss"
    check_ndim(where, "chosen_rewards", chosen_rewards, 1, "(num_pairs,)")
    check_same_shape(where, "chosen_rewards", chosen_rewards, rejected_rewards=rejected_rewards)
    if isinstance(margin, Tensor):
        check_same_shape(where, "chosen_rewards", chosen_rewards, margin=margin)
    if weights is None:
        weights = torch.ones_like(chosen_rewards)
    check_same_shape(where, "chosen_rewards", chosen_rewards, weights=weights)
    if normalizer is None:
        normalizer = weights.sum()
    elif not isinstance(normalizer, Tensor):
        check_positive(where, normalizer=normalizer)
    diff = chosen_rewards - rejected_rewards  # (P,)
    shifted = diff if margin is None else diff - margin
    loss = (weights * -F.logsigmoid(shifted)).sum() / normalizer
    with torch.no_grad():
        w = weights.detach() / weights.detach().sum().clamp_min(torch.finfo(weights.dtype).tiny)
        stats = RewardStats(
            accuracy=(w * (diff > 0).to(w.dtype)).sum(),
            margin=(w * diff).sum(),
            chosen_reward=(w * chosen_rewards).sum(),
            rejected_reward=(w * rejected_rewards).sum(),
        )
    return loss, stats


class RankingPairs(NamedTuple):
    """Pairs from rankings. Indices point into the concatenation of all rankings' responses."""

    chosen: Tensor  # (P,) int64, the better response of each pair
    rejected: Tensor  # (P,) int64, the worse one
    weights: Tensor  # (P,) float32, 1/C(K,2) for a pair from a ranking of K responses


def _check_ranking(ranking: Sequence[int], index: int) -> None:
    k = len(ranking)
    if k < 2:
        raise ValueError(f"rankings_to_pairs: ranking {index} has {k} response(s), expected at least 2")
    if sorted(ranking) != list(range(k)):
        raise ValueError(
            f"rankings_to_pairs: ranking {index} is {list(ranking)}, expected a permutation of 0..{k - 1} "
            "(response indices, best first; ties are not supported)"
        )


def rankings_to_pairs(rankings: Sequence[Sequence[int]]) -> RankingPairs:
    """Expand each ranking of K responses (indices best first) into its C(K,2) ordered pairs.

    Ranking j's responses are numbered 0..K_j−1 locally; in the output they are offset by the number
    of responses of the rankings before it, i.e. they index the responses concatenated in order.
    Each pair of ranking j gets weight 2/(K_j(K_j−1)), so every ranking sums to weight 1.
    """
    chosen: list[int] = []
    rejected: list[int] = []
    weights: list[float] = []
    offset = 0
    for j, ranking in enumerate(rankings):
        _check_ranking(ranking, j)
        k = len(ranking)
        w = 2.0 / (k * (k - 1))
        for a in range(k):
            for b in range(a + 1, k):
                chosen.append(offset + ranking[a])
                rejected.append(offset + ranking[b])
                weights.append(w)
        offset += k
    return RankingPairs(
        chosen=torch.tensor(chosen, dtype=torch.int64),
        rejected=torch.tensor(rejected, dtype=torch.int64),
        weights=torch.tensor(weights, dtype=torch.float32),
    )
