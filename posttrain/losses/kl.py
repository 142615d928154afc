"""KL estimators per token, the KL-shaped reward of PPO-RLHF, and KL coefficient controllers.

References:
- k1, k2, k3: Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx.html). With
  tokens sampled from the policy π and log r = log π_ref − log π:
  k1 = −log r (unbiased, can be negative), k2 = ½(log r)² (biased, low variance),
  k3 = (r − 1) − log r (unbiased, always ≥ 0 since x − 1 ≥ log x). GRPO's loss uses k3.
- KL-shaped reward: Ziegler et al. 2019, eq. 2, and InstructGPT (Ouyang et al. 2022), eq. 2:
  R(x, y) = r_φ(x, y) − β·log(π(y|x)/π_ref(y|x)), spread per token as −β·k1_t at every response
  token, with the score r_φ added at the last one.
- Adaptive controller: Ziegler et al. 2019, §2.2: e_t = clip(KL_t/KL_target − 1, −0.2, 0.2),
  β_{t+1} = β_t·(1 + K_β·e_t), with K_β = n_steps / horizon as in their released code.

Departures:
1. No clamping of k3's ratio: r = exp(log π_ref − log π) overflows fp32 only for a log-ratio above 88,
   far past any healthy run; an `inf` there is a signal, not something to hide.
2. The shaped reward can use any estimator (k1 by default, as the papers do).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.losses._enum import StrEnum
from posttrain.losses._masked import check_ndim, check_positive, check_same_shape, masked_count
from posttrain.losses._stats import Stats


def _check(where: str, logprobs: Tensor, ref_logprobs: Tensor) -> None:
    check_same_shape(where, "logprobs", logprobs, ref_logprobs=ref_logprobs)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log π − log π_ref per token. Shape: any, both the same."""
    _check("kl_k1", logprobs, ref_logprobs)
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = ½(log π − log π_ref)² per token. Shape: any, both the same."""
    _check("kl_k2", logprobs, ref_logprobs)
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(log π_ref − log π) − 1 − (log π_ref − log π) per token, ≥ 0. Shape: any, both the same."""
    _check("kl_k3", logprobs, ref_logprobs)
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r  # expm1 keeps precision for log_r near 0, where k3 ≈ ½ log_r²


class KLEstimator(StrEnum):
    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


KL_ESTIMATORS: dict[KLEstimator, Callable[[Tensor, Tensor], Tensor]] = {
    KLEstimator.K1: kl_k1,
    KLEstimator.K2: kl_k2,
    KLEstimator.K3: kl_k3,
}


@dataclass(frozen=True)
class KLRewardStats(Stats):
    kl: Tensor  # mean over sequences of Σ_t KL_t (the sequence-level KL estimate)
    non_score_reward: Tensor  # mean over sequences of Σ_t −β·KL_t
    score: Tensor  # mean score


@torch.no_grad()
def kl_penalty_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    estimator: KLEstimator = KLEstimator.K1,
) -> tuple[Tensor, KLRewardStats]:
    """Per-token rewards for PPO-RLHF: −β·KL_t at each masked-in token, + score at each row's last one.

    Shape: scores (B,) from the reward model/verifier; logprobs, ref_logprobs, mask (B, T) of the
    sampled response tokens → rewards (B, T), 0 where mask is 0. Detached (rewards are data).
    """
    where = "kl_penalty_rewards"
    check_ndim(where, "logprobs", logprobs, 2, "(batch, response_len)")
    check_same_shape(where, "logprobs", logprobs, ref_logprobs=ref_logprobs, mask=mask)
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"{where}: scores has shape {tuple(scores.shape)}, expected ({logprobs.shape[0]},)")
    if kl_coef < 0:
        raise ValueError(f"{where}: kl_coef must be >= 0, got {kl_coef}")
    keep = mask.bool()
    lengths = masked_count(keep, dim=-1)  # (B,)
    empty = (lengths == 0).nonzero().flatten()  # device sync; a row without tokens has no last token
    if empty.numel():
        raise ValueError(f"{where}: rows {empty.tolist()} have no tokens in mask")
    kl = torch.where(keep, KL_ESTIMATORS[estimator](logprobs.detach(), ref_logprobs.detach()), 0.0)
    rewards = -kl_coef * kl
    positions = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    last = torch.where(keep, positions, -1).amax(dim=-1)  # (B,) index of each row's last kept token
    rewards[torch.arange(keep.shape[0], device=keep.device), last] += scores.detach().to(rewards.dtype)
    stats = KLRewardStats(
        kl=kl.sum(-1).mean(),
        non_score_reward=(-kl_coef * kl).sum(-1).mean(),
        score=scores.detach().to(rewards.dtype).mean(),
    )
    return rewards, stats


class FixedKLController:
    """A constant β, with the adaptive controller's interface."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"FixedKLController: kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """β that moves KL toward `target`: β ← β·(1 + clip(KL/target − 1, ±0.2)·n_steps/horizon).

    Ziegler et al. 2019 use target 6 nats (per sequence), horizon 10000 samples, β₀ 0.2 (their §2.2).
    `n_steps` is the number of samples (sequences) behind this KL measurement.
    """

    def __init__(self, init_kl_coef: float, *, target: float, horizon: float) -> None:
        check_positive("AdaptiveKLController", init_kl_coef=init_kl_coef, target=target, horizon=horizon)
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        if n_steps < 0:
            raise ValueError(f"AdaptiveKLController.update: n_steps must be >= 0, got {n_steps}")
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
