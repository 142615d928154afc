"""Policy-gradient objectives: the PPO clipped surrogate (clip-higher, dual clip), value loss, entropy.

References:
- PPO: Schulman et al. 2017, eq. 7: L^CLIP = E_t[min(r_t·A_t, clip(r_t, 1−ε, 1+ε)·A_t)],
  r_t = π(a_t|s_t) / π_old(a_t|s_t); we minimize its negative.
- Clip-higher: DAPO (Yu et al. 2025), eq. 8: separate ε_low and ε_high, e.g. 0.2 / 0.28, so that
  low-probability tokens with A > 0 can grow further before the clip stops them.
- Dual clip: Ye et al. 2020 ("Mastering Complex Control in MOBA Games"), eq. 5: for A < 0 the
  objective is max(min(r·A, clip(r)·A), c·A), c > 1, which bounds the loss when r explodes.
- Clipped value loss: the PPO2 baselines implementation (as in InstructGPT's PPO):
  ½·max((V − R)², (clip(V, V_old − ε_v, V_old + ε_v) − R)²).
- Entropy bonus: Schulman et al. 2017, eq. 9 (the c₂·S term), here −c·H per token.

All three return PER-TOKEN losses (B, T), zero at masked-out positions: the reduction over tokens and
sequences is chosen once, in `aggregation`, so each objective reads like its equation.

Departures:
1. The log-ratio is computed only at masked-in positions (padding gets log r = 0), so garbage
   log-probs in padding can neither overflow exp() nor send NaN gradients through the mask.
2. Clip fractions count the tokens whose gradient the clip actually zeroes: r < 1−ε_low with A < 0
   ("low"), r > 1+ε_high with A > 0 ("high"), and r > c with A < 0 for the dual clip. Some trainers
   count |r − 1| > ε regardless of the sign of A, which also counts tokens that still get a gradient.
3. approx_kl is Schulman's k3 estimator of KL(π_old ‖ π) on the sampled tokens, mean over tokens.

Off-policy (stale or mismatched) samples — `decoupled_ppo_loss`:
- Decoupled PPO: Hilton, Cobbe & Schulman 2022, "Batch size-invariance for policy optimization" (arXiv 2110.00641), the decoupled PPO-clip objective:
  the trust region is centred on a *proximal* policy π_prox, not on the behaviour policy π_behav that
  sampled, and the off-policy correction is a separate importance weight:
  L = E_{a∼π_behav}[ (π_prox/π_behav) · min(r·A, clip(r, 1−ε, 1+ε)·A) ],  r = π_θ/π_prox.
  AReaL (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
  Reasoning", eq. 5 — the number as issue 22 cites it; the equation numbers were not re-checked against the papers) uses it for asynchronous RL, with π_prox the learner's weights before the update.
- Truncated importance sampling: Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training": the weight of the sampler/learner mismatch is truncated, min(π_learner/π_sampler, C)
  (C = 2 in their runs), so a token the sampler drew far more rarely than the learner would cannot
  dominate the batch.
Departures:
4. The weight π_prox/π_behav is always truncated at C (AReaL leaves it untruncated by default and offers
   a cap); it is a constant (no gradient), computed at masked-in tokens only (padding gets weight 0).
5. `is_truncated_frac` counts the tokens whose weight the cap lowered (π_prox/π_behav > C); tokens with a
   small weight (π_prox ≪ π_behav) are kept at their weight — only the upper tail is cut, as in the papers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.losses._masked import check_ndim, check_positive, check_same_shape, masked_mean
from posttrain.losses._stats import Stats


@dataclass(frozen=True)
class PolicyStats(Stats):
    clip_frac_low: Tensor  # share of tokens with r < 1 − ε_low and A < 0 (zero gradient)
    clip_frac_high: Tensor  # share of tokens with r > 1 + ε_high and A > 0 (zero gradient)
    dual_clip_frac: Tensor  # share of tokens with A < 0 and r > c (0 without dual clip)
    approx_kl: Tensor  # mean of (r − 1) − log r
    ratio_mean: Tensor
    ratio_max: Tensor


@dataclass(frozen=True)
class OffPolicyStats(Stats):
    is_weight_mean: Tensor      # mean over tokens of min(π_prox/π_behav, C)
    is_truncated_frac: Tensor   # share of tokens with π_prox/π_behav > C
    log_ratio_abs_mean: Tensor  # mean |log π_prox − log π_behav|: how far the behaviour policy is from the proximal one


@dataclass(frozen=True)
class MismatchStats(Stats):
    logprob_abs_mean: Tensor  # mean |log π_behav − log π_θ| over response tokens
    kl: Tensor                # k3 estimate of KL(π_behav ‖ π_θ) on the sampled tokens: mean of (r − 1) − log r, r = π_θ/π_behav


@dataclass(frozen=True)
class ValueStats(Stats):
    clip_frac: Tensor  # share of tokens where the clipped error was the larger one
    mse: Tensor  # mean (V − R)², unclipped
    value_mean: Tensor


def _check_token_inputs(where: str, ref_name: str, ref: Tensor, mask: Tensor, **others: Tensor) -> None:
    check_ndim(where, ref_name, ref, 2, "(batch, response_len)")
    check_same_shape(where, ref_name, ref, mask=mask, **others)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, PolicyStats]:
    """Per-token −min(r·A, clip(r, 1−clip_low, 1+clip_high)·A), optionally dual-clipped at −c·A for A < 0.

    Shape: logprobs, old_logprobs, mask (B, T); advantages (B, T), or (B, 1) for one advantage per
    sequence (GRPO), broadcast over tokens. Returns the loss (B, T), 0 where mask is 0.
    Symmetric PPO: clip_low = clip_high = ε. DAPO: clip_low = 0.2, clip_high = 0.28.
    """
    where = "ppo_clip_loss"
    _check_token_inputs(where, "logprobs", logprobs, mask, old_logprobs=old_logprobs)
    if advantages.shape not in (logprobs.shape, (logprobs.shape[0], 1)):
        raise ValueError(f"{where}: advantages has shape {tuple(advantages.shape)}, expected "
                         f"{tuple(logprobs.shape)} or ({logprobs.shape[0]}, 1)")
    check_positive(where, clip_low=clip_low, clip_high=clip_high)
    if clip_low >= 1:
        raise ValueError(f"{where}: clip_low must be < 1 (the ratio floor is 1 − clip_low), got {clip_low}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"{where}: dual_clip must be > 1, got {dual_clip}")
    keep = mask.bool()
    advantages = advantages.expand_as(logprobs)
    log_ratio = torch.where(keep, logprobs - old_logprobs.detach(), 0.0)  # departure 1
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)  # −min(r·A, clip(r)·A)
    if dual_clip is not None:
        # For A < 0 cap the loss at −c·A (> 0): its gradient is then zero however large r gets.
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    loss = torch.where(keep, loss, 0.0)
    with torch.no_grad():
        r, a = ratio.detach(), advantages.detach()
        low = (r < 1 - clip_low) & (a < 0)
        high = (r > 1 + clip_high) & (a > 0)
        dual = (a < 0) & (r > dual_clip) if dual_clip is not None else torch.zeros_like(keep)
        f = r.dtype
        stats = PolicyStats(
            clip_frac_low=masked_mean(low.to(f), keep),
            clip_frac_high=masked_mean(high.to(f), keep),
            dual_clip_frac=masked_mean(dual.to(f), keep),
            approx_kl=masked_mean((r - 1) - log_ratio.detach(), keep),
            ratio_mean=masked_mean(r, keep),
            ratio_max=r.masked_fill(~keep, 0.0).max() if r.numel() else r.new_zeros(()),  # r > 0: 0 never wins
        )
    return loss, stats


def truncated_is_weights(prox_logprobs: Tensor, behav_logprobs: Tensor, mask: Tensor, *, cap: float
                         ) -> tuple[Tensor, OffPolicyStats]:
    """Per-token min(π_prox/π_behav, cap), detached, 0 where mask is 0 (departures 4, 5).

    Shape: (B, T) each. The ratio is formed from log-probs at masked-in tokens only (padding gets
    log w = 0 before the mask), so padding cannot overflow exp()."""
    where = "truncated_is_weights"
    _check_token_inputs(where, "prox_logprobs", prox_logprobs, mask, behav_logprobs=behav_logprobs)
    check_positive(where, cap=cap)
    keep = mask.bool()
    with torch.no_grad():
        log_w = torch.where(keep, prox_logprobs.detach() - behav_logprobs.detach(), 0.0)
        raw = torch.exp(log_w)
        w = torch.where(keep, torch.clamp(raw, max=cap), 0.0)
        f = w.dtype
        stats = OffPolicyStats(is_weight_mean=masked_mean(w, keep),
                               is_truncated_frac=masked_mean((raw > cap).to(f), keep),
                               log_ratio_abs_mean=masked_mean(log_w.abs(), keep))
    return w, stats


def decoupled_ppo_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    is_cap: float,
) -> tuple[Tensor, PolicyStats, OffPolicyStats]:
    """Per-token −min(π_prox/π_behav, C) · min(r·A, clip(r, 1−clip_low, 1+clip_high)·A), r = π_θ/π_prox
    (decoupled PPO, Hilton et al. 2022 / AReaL eq. 5, with the weight truncated as in Yao et al. 2025).

    Shape: logprobs (π_θ, with grad), prox_logprobs, behav_logprobs, mask (B, T); advantages (B, T) or
    (B, 1). Returns the loss (B, T) (0 outside the mask), the clip stats (of r against π_prox) and the
    importance-weight stats. With π_prox = π_behav it is `ppo_clip_loss` exactly (every weight is 1)."""
    _check_token_inputs("decoupled_ppo_loss", "logprobs", logprobs, mask, prox_logprobs=prox_logprobs,
                        behav_logprobs=behav_logprobs)
    w, is_stats = truncated_is_weights(prox_logprobs, behav_logprobs, mask, cap=is_cap)
    loss, stats = ppo_clip_loss(logprobs, prox_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    return w * loss, stats, is_stats


def sampler_mismatch(logprobs: Tensor, behav_logprobs: Tensor, mask: Tensor) -> MismatchStats:
    """How far the learner's log-probs (π_θ, first update pass) are from the sampler's on the sampled tokens:
    mean |Δ log π| and the k3 estimate of KL(π_behav ‖ π_θ). Shape: (B, T) each. Detached."""
    _check_token_inputs("sampler_mismatch", "logprobs", logprobs, mask, behav_logprobs=behav_logprobs)
    keep = mask.bool()
    with torch.no_grad():
        log_r = torch.where(keep, logprobs.detach() - behav_logprobs.detach(), 0.0)  # log π_θ/π_behav
        return MismatchStats(logprob_abs_mean=masked_mean(log_r.abs(), keep),
                             kl=masked_mean(torch.expm1(log_r) - log_r, keep))


def value_loss(values: Tensor, returns: Tensor, mask: Tensor) -> tuple[Tensor, ValueStats]:
    """Per-token ½(V − R)², 0 where mask is 0. Shape: (B, T) each."""
    _check_token_inputs("value_loss", "values", values, mask, returns=returns)
    err = torch.where(mask.bool(), values - returns.detach(), 0.0)
    loss = 0.5 * err**2
    with torch.no_grad():
        stats = ValueStats(clip_frac=values.new_zeros(()), mse=masked_mean(err.detach() ** 2, mask),
                           value_mean=masked_mean(values.detach(), mask))
    return loss, stats


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float
) -> tuple[Tensor, ValueStats]:
    """Per-token ½·max((V − R)², (clip(V, V_old − clip, V_old + clip) − R)²), 0 where mask is 0.

    Shape: values (B, T) from the value head now; old_values (B, T) at rollout time; returns (B, T).
    """
    where = "clipped_value_loss"
    _check_token_inputs(where, "values", values, mask, old_values=old_values, returns=returns)
    check_positive(where, clip=clip)
    keep = mask.bool()
    old, target = old_values.detach(), returns.detach()
    clipped_values = old + torch.clamp(values - old, -clip, clip)
    err_unclipped = torch.where(keep, values - target, 0.0)
    err_clipped = torch.where(keep, clipped_values - target, 0.0)
    loss = 0.5 * torch.maximum(err_unclipped**2, err_clipped**2)
    with torch.no_grad():
        took_clipped = err_clipped.detach() ** 2 > err_unclipped.detach() ** 2
        stats = ValueStats(
            clip_frac=masked_mean(took_clipped.to(values.dtype), keep),
            mse=masked_mean(err_unclipped.detach() ** 2, keep),
            value_mean=masked_mean(values.detach(), keep),
        )
    return loss, stats


def entropy_bonus(token_entropy: Tensor, mask: Tensor, *, coef: float) -> Tensor:
    """Per-token −coef·H (minimizing it raises entropy), 0 where mask is 0. Shape: (B, T) each.

    token_entropy comes from `entropy_from_logits`; aggregate it like the policy loss and add.
    """
    _check_token_inputs("entropy_bonus", "token_entropy", token_entropy, mask)
    return torch.where(mask.bool(), -coef * token_entropy, 0.0)
