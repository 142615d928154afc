"""Advantages and returns: GAE, group baselines (GRPO, Dr. GRPO, RLOO), REINFORCE++, whitening.

References:
- GAE: Schulman et al. 2016, eqs. 11–16: δ_t = r_t + γ·V(s_{t+1}) − V(s_t), Â_t = Σ_l (γλ)^l δ_{t+l};
  returns R_t = Â_t + V(s_t) are the value targets.
- GRPO: Shao et al. 2024 (DeepSeekMath), §4.1.2: Â_i = (r_i − mean(r)) / std(r) over the G samples
  of one prompt, the same for every token of sample i.
- Dr. GRPO: Liu et al. 2025, §3.1: Â_i = r_i − mean(r), the std division removed (it up-weights
  prompts whose rewards barely vary: the too-easy and the too-hard).
- RLOO: Ahmadian et al. 2024, eq. 6 (after Kool et al. 2019): Â_i = r_i − (1/(G−1)) Σ_{j≠i} r_j.
- REINFORCE++: Hu 2025, §3: per-token rewards (score at the end, −β·KL at every token), the
  undiscounted return-to-go, normalized by the mean and std of the WHOLE batch's tokens.

Conventions: sequence rewards are flat (N,) with the G samples of each prompt consecutive, N = P·G.
Token tensors are (B, T) with a mask. Advantages are constants of the policy loss: every function
runs under no_grad and returns detached tensors.

Departures:
1. GAE skips masked-out positions as if they were not there (the next value and advantage carry over
   them), so tool-output or padding tokens inside a response do not break the recursion; the step
   after the last masked-in token is terminal (V = 0), truncated responses included.
2. std is the unbiased (Bessel-corrected) one, as torch.std and the public GRPO/whitening code
   compute it; eps is added to the std (GRPO) or to the variance (whitening) as noted per function.
3. REINFORCE++ normalizes over the tensor passed in: pass the whole optimizer batch (gathered across
   ranks) for the paper's "global" normalization.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.losses._masked import check_ndim, check_same_shape, masked_count, masked_mean, masked_sum


def _check_tokens(where: str, rewards: Tensor, mask: Tensor, **others: Tensor) -> None:
    check_ndim(where, "rewards", rewards, 2, "(batch, response_len)")
    check_same_shape(where, "rewards", rewards, mask=mask, **others)


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the masked-in tokens of each row.

    Shape: rewards, values, mask (B, T) → (advantages, returns), each (B, T) and 0 where mask is 0.
    Cost: a Python loop over T of O(B) tensor ops (fine for T in the thousands; it is not the hot path).
    """
    _check_tokens("gae", rewards, mask, values=values)
    for name, v in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"gae: {name} must be in [0, 1], got {v}")
    keep = mask.bool()
    rewards, values = rewards.detach(), values.detach()
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])  # (B,) V(s_{t+1}); 0 after the last token
    next_adv = rewards.new_zeros(rewards.shape[0])  # (B,) Â_{t+1}
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        k = keep[:, t]
        advantages[:, t] = torch.where(k, adv_t, 0.0)
        next_value = torch.where(k, values[:, t], next_value)  # departure 1: carry over masked steps
        next_adv = torch.where(k, adv_t, next_adv)
    returns = torch.where(keep, advantages + values, 0.0)
    return advantages, returns


@torch.no_grad()
def discounted_returns(rewards: Tensor, mask: Tensor, *, gamma: float) -> Tensor:
    """Return-to-go G_t = Σ_{s ≥ t} γ^{s−t} r_s over masked-in tokens (GAE with V = 0, λ = 1). (B, T) → (B, T)."""
    _check_tokens("discounted_returns", rewards, mask)
    advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma=gamma, lam=1.0)
    return advantages


def _groups(where: str, rewards: Tensor, group_size: int) -> Tensor:
    check_ndim(where, "rewards", rewards, 1, "(num_prompts · group_size,) with each group consecutive")
    if group_size < 2:
        raise ValueError(f"{where}: group_size must be >= 2 (a group of 1 has no baseline), got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{where}: {rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.detach().reshape(-1, group_size)  # (P, G)


@torch.no_grad()
def grpo_advantages(rewards: Tensor, *, group_size: int, eps: float = 1e-6) -> Tensor:
    """(r − mean_group) / (std_group + eps), std unbiased. Shape: (N,) → (N,). Equal rewards → 0."""
    g = _groups("grpo_advantages", rewards, group_size)
    mean = g.mean(dim=1, keepdim=True)
    std = g.std(dim=1, keepdim=True)  # unbiased (departure 2)
    return ((g - mean) / (std + eps)).reshape(-1)


@torch.no_grad()
def dr_grpo_advantages(rewards: Tensor, *, group_size: int) -> Tensor:
    """r − mean_group, no std division (Dr. GRPO). Shape: (N,) → (N,)."""
    g = _groups("dr_grpo_advantages", rewards, group_size)
    return (g - g.mean(dim=1, keepdim=True)).reshape(-1)


@torch.no_grad()
def rloo_advantages(rewards: Tensor, *, group_size: int) -> Tensor:
    """r_i − mean of the other G−1 rewards of its group = G/(G−1)·(r_i − mean_group). (N,) → (N,)."""
    g = _groups("rloo_advantages", rewards, group_size)
    loo_baseline = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - loo_baseline).reshape(-1)


@torch.no_grad()
def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x − μ) / sqrt(σ² + eps) over the masked-in elements (σ² unbiased); 0 where mask is 0.

    shift_mean=False adds μ back (scales without centring: the convention for whitening rewards).
    Shape: any, mask the same shape. Needs at least 2 masked-in elements (a device sync checks it).
    """
    check_same_shape("masked_whiten", "values", values, mask=mask)
    n = masked_count(mask).item()
    if n < 2:
        raise ValueError(f"masked_whiten: needs at least 2 masked-in elements for a variance, got {n}")
    keep = mask.bool()
    values = values.detach()
    mean = masked_mean(values, keep)
    var = masked_sum((values - mean) ** 2, keep) / (n - 1)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(keep, whitened, 0.0)


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """REINFORCE++: return-to-go of the per-token rewards, whitened over every masked-in token passed.

    Shape: token_rewards (B, T) (e.g. from `kl.kl_penalty_rewards`: −β·KL per token, score added at
    each row's last token), mask (B, T) → (B, T), 0 where mask is 0.
    """
    _check_tokens("reinforce_pp_advantages", token_rewards, mask)
    return masked_whiten(discounted_returns(token_rewards, mask, gamma=gamma), mask)
