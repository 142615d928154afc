"""Loss aggregation: from per-token losses (B, T) to the scalar an optimizer step minimizes.

The three modes, over one optimizer batch of sequences i with response lengths |o_i|:
- token_mean (DAPO, Yu et al. 2025, eq. 12):       L = Σ_i Σ_t ℓ_it / Σ_i |o_i|
- seq_mean_token_mean (GRPO, Shao et al. 2024, eq. 3): L = (1/G) Σ_i (1/|o_i|) Σ_t ℓ_it
- seq_mean_token_sum_norm (Dr. GRPO, Liu et al. 2025, §3.1): L = (1/G) Σ_i Σ_t ℓ_it / L_max,
  L_max a constant (the generation budget), so no sequence's tokens are reweighted by its length.

They differ in how they weight a token of a long response against one of a short response — the
length bias that Dr. GRPO points out in GRPO — and that is a choice made once per run (`Aggregation`),
never re-branched inside a loss.

Micro-batching is exact when the normalizers come from the WHOLE optimizer batch: every function
takes a `LossNormalizer` built by `loss_normalizer(full_mask)` before the batch is split, and the
micro-batch losses then SUM to the full-batch loss (and their gradients to its gradient). The naive
alternative, a mean within each micro-batch averaged over micro-batches, is not the token mean when
micro-batches hold different numbers of tokens (see tests/test_losses_aggregation.py).

Departures:
1. In seq_mean_token_mean a sequence with no masked-in token contributes 0 (its mean is 0/0) but
   still counts in G, as it did in the full batch's count.
2. Across data-parallel ranks, count over all ranks; the ranks' gradients are then summed
   (`posttrain.distributed.all_reduce_gradients`), not averaged, so no loss is scaled by the world size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

from posttrain.losses._enum import StrEnum
from posttrain.losses._masked import check_ndim, check_same_shape, masked_count, masked_sum


class LossNormalizer(NamedTuple):
    """Counts of the whole optimizer batch (all micro-batches; all ranks, if data-parallel)."""

    num_tokens: float  # masked-in tokens: token_mean's denominator
    num_sequences: float  # sequences (rows), empty ones included: G in the sequence means
    constant_length: float | None  # Dr. GRPO's L_max (e.g. max_new_tokens); None if unused


def loss_normalizer(mask: Tensor, *, constant_length: float | None = None) -> LossNormalizer:
    """Count a full optimizer batch's mask (B, T) once, before splitting it into micro-batches.

    One device sync (the token count) per optimizer step.
    """
    check_ndim("loss_normalizer", "mask", mask, 2, "(batch, response_len)")
    if constant_length is not None and not constant_length > 0:
        raise ValueError(f"loss_normalizer: constant_length must be > 0, got {constant_length}")
    num_tokens = float(masked_count(mask).item())
    if num_tokens == 0:
        raise ValueError(f"loss_normalizer: mask of shape {tuple(mask.shape)} has no tokens; nothing to train on")
    return LossNormalizer(num_tokens=num_tokens, num_sequences=float(mask.shape[0]),
                          constant_length=None if constant_length is None else float(constant_length))


def _check(where: str, loss: Tensor, mask: Tensor) -> None:
    check_ndim(where, "loss", loss, 2, "(batch, response_len) of per-token losses")
    check_same_shape(where, "loss", loss, mask=mask)


def token_mean(loss: Tensor, mask: Tensor, norm: LossNormalizer) -> Tensor:
    """Σ_{i,t} mask·ℓ / norm.num_tokens. Shape: loss, mask (B, T) of this micro-batch → ()."""
    _check("token_mean", loss, mask)
    return masked_sum(loss, mask) / norm.num_tokens


def seq_mean_token_mean(loss: Tensor, mask: Tensor, norm: LossNormalizer) -> Tensor:
    """Σ_i (Σ_t mask·ℓ / |o_i|) / norm.num_sequences. Shape: (B, T) → (). Sequences must not be split."""
    _check("seq_mean_token_mean", loss, mask)
    lengths = masked_count(mask, dim=-1, dtype=loss.dtype).clamp_min(1)  # (B,), departure 1
    return (masked_sum(loss, mask, dim=-1) / lengths).sum() / norm.num_sequences


def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, norm: LossNormalizer) -> Tensor:
    """Σ_{i,t} mask·ℓ / (norm.num_sequences · norm.constant_length). Shape: (B, T) → ()."""
    _check("seq_mean_token_sum_norm", loss, mask)
    if norm.constant_length is None:
        raise ValueError("seq_mean_token_sum_norm: the LossNormalizer has constant_length=None; build it with "
                         "loss_normalizer(mask, constant_length=<max response tokens>)")
    return masked_sum(loss, mask) / (norm.num_sequences * norm.constant_length)


class Aggregation(StrEnum):
    TOKEN_MEAN = "token_mean"  # DAPO
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"  # GRPO
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"  # Dr. GRPO


AggregationFn = Callable[[Tensor, Tensor, LossNormalizer], Tensor]

AGGREGATIONS: dict[Aggregation, AggregationFn] = {
    Aggregation.TOKEN_MEAN: token_mean,
    Aggregation.SEQ_MEAN_TOKEN_MEAN: seq_mean_token_mean,
    Aggregation.SEQ_MEAN_TOKEN_SUM_NORM: seq_mean_token_sum_norm,
}
