"""The DPO family: offline preference objectives on sequence log-probabilities.

Each function takes per-sequence log-probabilities, (B,) tensors, already reduced over the response
tokens by the caller — and the reduction differs by method, which is why it is in every signature:

| method | paper (equation)                         | log-probs it expects                   | reference |
|--------|------------------------------------------|----------------------------------------|-----------|
| DPO    | Rafailov et al. 2023, eq. 7              | summed (`sequence_logprob_sum`)        | yes       |
| cDPO   | Mitchell 2023, label-smoothed DPO        | summed                                 | yes       |
| IPO    | Azar et al. 2023, eq. 17                 | summed                                 | yes       |
| KTO    | Ethayarajh et al. 2024, eq. 8 (unpaired) | summed                                 | yes       |
| ORPO   | Hong et al. 2024, eqs. 6–7               | length-normalized (`sequence_logprob_mean`) | no   |
| SimPO  | Meng et al. 2024, eq. 6                  | length-normalized                      | no        |

`PREFERENCE_METHODS` maps each `PreferenceLoss` to its function and these conventions, so a stage
chooses once. Every loss is Σ_i ℓ_i / normalizer: normalizer None = this call's batch size; for
gradient accumulation pass the size of the whole optimizer batch.

Stats (all methods): implicit rewards of chosen and rejected (β × the quantity the method compares),
their margin, the preference accuracy, and the raw policy log-probs of chosen and rejected — the
likelihood-displacement signal (both falling while the margin grows).

Departures:
1. IPO takes summed log-probs as in the paper; TRL's "ipo" averages over tokens. Pass
   `sequence_logprob_mean` outputs to reproduce TRL.
2. KTO's reference point z0 is an explicit input (`kto_reference_point` computes the paper's
   estimate, max(0, mean KL over mismatched pairs), detached); the per-example loss is the paper's
   λ_y − v(x, y), i.e. λ_D·σ(−β(r − z0)) for desirable and λ_U·σ(−β(z0 − r)) for undesirable examples.
3. ORPO's NLL term is the per-sequence length-normalized NLL of the chosen response, averaged over
   pairs (the paper's L_SFT with its eq. 2 normalization); TRL uses a token mean over the batch.
   The odds use log(1 − p) = log(−expm1(log p)), exact near p → 1 where log1p(−p) is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.losses._enum import StrEnum
from posttrain.losses._masked import check_ndim, check_positive, check_same_shape
from posttrain.losses._stats import Stats


@dataclass(frozen=True)
class PreferenceStats(Stats):
    chosen_rewards: Tensor  # mean implicit reward of chosen (KTO: desirable) responses
    rejected_rewards: Tensor  # mean implicit reward of rejected (KTO: undesirable) responses
    margin: Tensor  # chosen_rewards − rejected_rewards (paired: mean of per-pair margins)
    accuracy: Tensor  # share of pairs with reward_chosen > reward_rejected (KTO: see kto_loss)
    chosen_logps: Tensor  # mean policy log-prob of chosen, as passed in (summed or normalized)
    rejected_logps: Tensor  # mean policy log-prob of rejected, as passed in


@dataclass(frozen=True)
class ORPOStats(PreferenceStats):
    nll: Tensor  # mean length-normalized NLL of chosen (the SFT term)
    log_odds_ratio: Tensor  # mean log(odds(chosen) / odds(rejected))


@dataclass(frozen=True)
class KTOStats(PreferenceStats):
    reference_point: Tensor  # z0 used
    num_desirable: Tensor
    num_undesirable: Tensor


def _normalize(where: str, losses: Tensor, normalizer: float | Tensor | None) -> Tensor:
    if normalizer is None:
        return losses.mean() if losses.numel() else losses.sum()
    if not isinstance(normalizer, Tensor):
        check_positive(where, normalizer=normalizer)
    return losses.sum() / normalizer


def _check_pairs(where: str, **tensors: Tensor) -> None:
    (first_name, first), *_ = tensors.items()
    check_ndim(where, first_name, first, 1, "(batch,) of sequence log-probs")
    check_same_shape(where, first_name, first, **tensors)


@torch.no_grad()
def _paired_stats(chosen_rewards: Tensor, rejected_rewards: Tensor, chosen_logps: Tensor,
                  rejected_logps: Tensor) -> dict[str, Tensor]:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return dict(
        chosen_rewards=chosen_rewards.mean(),
        rejected_rewards=rejected_rewards.mean(),
        margin=(chosen_rewards - rejected_rewards).mean(),
        accuracy=(chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean(),
        chosen_logps=chosen_logps.detach().mean(),
        rejected_logps=rejected_logps.detach().mean(),
    )


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, PreferenceStats]:
    """DPO: −(1−ε)·log σ(β·h) − ε·log σ(−β·h), h = (π_c − ref_c) − (π_r − ref_r).

    Inputs: SUMMED response log-probs, shape (B,). ε = label_smoothing ∈ [0, 0.5): conservative DPO
    (the labels are flipped with probability ε). Implicit rewards: β·(π − ref).
    """
    where = "dpo_loss"
    _check_pairs(where, policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps,
                 ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    check_positive(where, beta=beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"{where}: label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_logratios = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected_logratios = policy_rejected_logps - ref_rejected_logps  # (B,)
    logits = beta * (chosen_logratios - rejected_logratios)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    stats = PreferenceStats(**_paired_stats(beta * chosen_logratios, beta * rejected_logratios,
                                            policy_chosen_logps, policy_rejected_logps))
    return _normalize(where, losses, normalizer), stats


def ipo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, PreferenceStats]:
    """IPO: (h − 1/(2β))², h = (π_c − ref_c) − (π_r − ref_r); β is the paper's τ.

    Inputs: SUMMED response log-probs, shape (B,) (see departure 1). Implicit rewards: β·(π − ref).
    """
    where = "ipo_loss"
    _check_pairs(where, policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps,
                 ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    check_positive(where, beta=beta)
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    losses = (chosen_logratios - rejected_logratios - 1 / (2 * beta)) ** 2
    stats = PreferenceStats(**_paired_stats(beta * chosen_logratios, beta * rejected_logratios,
                                            policy_chosen_logps, policy_rejected_logps))
    return _normalize(where, losses, normalizer), stats


def kto_reference_point(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """KTO's z0 = max(0, mean(π − ref)) over MISMATCHED pairs (x_i, y_j), j ≠ i; detached (0-d).

    Shape: (M,) summed log-probs of each mismatched completion under policy and reference.
    """
    _check_pairs("kto_reference_point", policy_kl_logps=policy_kl_logps, ref_kl_logps=ref_kl_logps)
    if policy_kl_logps.numel() == 0:
        raise ValueError("kto_reference_point: needs at least one mismatched pair, got 0")
    return (policy_kl_logps - ref_kl_logps).detach().mean().clamp_min(0)


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    *,
    reference_point: Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, KTOStats]:
    """KTO on unpaired examples: λ_y − v(x, y), with r = π − ref and
    v = λ_D·σ(β(r − z0)) if desirable, λ_U·σ(β(z0 − r)) if undesirable.

    Inputs: SUMMED response log-probs (B,); desirable (B,) bool label; reference_point z0 from
    `kto_reference_point` (no gradient flows through it). λ_D, λ_U = desirable/undesirable_weight,
    chosen so that λ_D·n_D / (λ_U·n_U) ∈ [1, 4/3] (paper §4.2). Stats: "chosen" = desirable; accuracy =
    share of examples on the right side of z0 (r > z0 if desirable, r < z0 if not); class means are 0
    for a class absent from the batch.
    """
    where = "kto_loss"
    _check_pairs(where, policy_logps=policy_logps, ref_logps=ref_logps)
    check_same_shape(where, "policy_logps", policy_logps, desirable=desirable)
    if desirable.dtype != torch.bool:
        raise ValueError(f"{where}: desirable must be a bool tensor, got {desirable.dtype}")
    check_positive(where, beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    z0 = torch.as_tensor(reference_point, dtype=policy_logps.dtype, device=policy_logps.device).detach()
    logratios = policy_logps - ref_logps  # (B,)
    losses = torch.where(
        desirable,
        desirable_weight * torch.sigmoid(-beta * (logratios - z0)),
        undesirable_weight * torch.sigmoid(-beta * (z0 - logratios)),
    )
    with torch.no_grad():
        r = beta * logratios.detach()
        d = desirable.to(r.dtype)
        u = 1 - d
        n_d, n_u = d.sum(), u.sum()
        chosen = (r * d).sum() / n_d.clamp_min(1)
        rejected = (r * u).sum() / n_u.clamp_min(1)
        right = torch.where(desirable, logratios.detach() > z0, logratios.detach() < z0).to(r.dtype)
        stats = KTOStats(
            chosen_rewards=chosen,
            rejected_rewards=rejected,
            margin=chosen - rejected,
            accuracy=right.mean() if right.numel() else right.sum(),
            chosen_logps=(policy_logps.detach() * d).sum() / n_d.clamp_min(1),
            rejected_logps=(policy_logps.detach() * u).sum() / n_u.clamp_min(1),
            reference_point=z0,
            num_desirable=n_d,
            num_undesirable=n_u,
        )
    return _normalize(where, losses, normalizer), stats


def _log_odds(mean_logps: Tensor) -> Tensor:
    """log(p / (1 − p)) from log p < 0; log(1 − p) = log(−expm1(log p)) stays exact as p → 1."""
    return mean_logps - torch.log(-torch.expm1(mean_logps))


def orpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    *,
    beta: float,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, ORPOStats]:
    """ORPO: −ℓ_c + β·(−log σ(log odds(y_c) − log odds(y_l))), odds(y) = p/(1−p), p = exp(ℓ).

    Inputs: LENGTH-NORMALIZED response log-probs ℓ (B,), strictly negative; no reference model.
    β is the paper's λ (TRL also calls it beta). Implicit rewards: β·ℓ.
    """
    where = "orpo_loss"
    _check_pairs(where, policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps)
    check_positive(where, beta=beta)
    log_odds_ratio = _log_odds(policy_chosen_logps) - _log_odds(policy_rejected_logps)  # (B,)
    nll = -policy_chosen_logps
    losses = nll - beta * F.logsigmoid(log_odds_ratio)
    stats = ORPOStats(
        **_paired_stats(beta * policy_chosen_logps, beta * policy_rejected_logps,
                        policy_chosen_logps, policy_rejected_logps),
        nll=nll.detach().mean(),
        log_odds_ratio=log_odds_ratio.detach().mean(),
    )
    return _normalize(where, losses, normalizer), stats


def simpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    *,
    beta: float,
    gamma: float,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, PreferenceStats]:
    """SimPO: −log σ(β·ℓ_c − β·ℓ_r − γ), with γ the target reward margin.

    Inputs: LENGTH-NORMALIZED response log-probs ℓ (B,); no reference model. Implicit rewards: β·ℓ.
    (TRL parameterizes γ as gamma_beta_ratio = γ/β.)
    """
    where = "simpo_loss"
    _check_pairs(where, policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps)
    check_positive(where, beta=beta)
    chosen_rewards = beta * policy_chosen_logps
    rejected_rewards = beta * policy_rejected_logps
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    stats = PreferenceStats(**_paired_stats(chosen_rewards, rejected_rewards,
                                            policy_chosen_logps, policy_rejected_logps))
    return _normalize(where, losses, normalizer), stats


class PreferenceLoss(StrEnum):
    DPO = "dpo"
    IPO = "ipo"
    KTO = "kto"
    ORPO = "orpo"
    SIMPO = "simpo"


class PreferenceMethod(NamedTuple):
    """What a stage needs to know about a method before it computes any log-prob."""

    loss_fn: Callable[..., tuple[Tensor, PreferenceStats]]
    length_normalized: bool  # True: reduce with sequence_logprob_mean; False: sequence_logprob_sum
    uses_reference: bool  # needs the frozen reference model's log-probs
    paired: bool  # chosen/rejected pairs (False: KTO's labelled single examples)


PREFERENCE_METHODS: dict[PreferenceLoss, PreferenceMethod] = {
    PreferenceLoss.DPO: PreferenceMethod(dpo_loss, length_normalized=False, uses_reference=True, paired=True),
    PreferenceLoss.IPO: PreferenceMethod(ipo_loss, length_normalized=False, uses_reference=True, paired=True),
    PreferenceLoss.KTO: PreferenceMethod(kto_loss, length_normalized=False, uses_reference=True, paired=False),
    PreferenceLoss.ORPO: PreferenceMethod(orpo_loss, length_normalized=True, uses_reference=False, paired=True),
    PreferenceLoss.SIMPO: PreferenceMethod(simpo_loss, length_normalized=True, uses_reference=False, paired=True),
}
