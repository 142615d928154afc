"""Supervised fine-tuning: masked token cross-entropy on the response tokens.

Objective (the maximum-likelihood term of InstructGPT's SFT stage, Ouyang et al. 2022 §3.5, and of any
causal LM): L = −(1/N) Σ_{i,t} m_{i,t} · log π(y_{i,t} | x_i, y_{i,<t}), where m masks in response
tokens (prompt and padding are 0) and N is the normalizer.

Normalization, stated once: with N = the number of masked-in tokens in the whole optimizer batch
(all micro-batches, all ranks), summing the micro-batch losses gives exactly the loss — and the
gradient — of the one big batch (the "token mean" of the big batch). Dividing each micro-batch by its
own token count instead would weight a token in a short micro-batch more than one in a long one.
N = 1 gives the token sum.

Departures:
1. Takes per-token log-probs (from `token_logprobs`), not logits, so the one memory-efficient
   log-prob path serves SFT, DPO and PPO alike.
2. N is an explicit argument with no default: the caller counts tokens over the full batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.losses._masked import check_ndim, check_positive, check_same_shape, masked_count, masked_sum
from posttrain.losses._stats import Stats


@dataclass(frozen=True)
class SFTStats(Stats):
    nll_sum: Tensor  # Σ −log π over this call's masked-in tokens
    num_tokens: Tensor  # masked-in tokens in this call
    nll_per_token: Tensor  # nll_sum / num_tokens (this call only; 0 if it has no tokens)


def sft_loss(token_logps: Tensor, mask: Tensor, *, num_tokens: float | Tensor) -> tuple[Tensor, SFTStats]:
    """−Σ mask·log π / num_tokens.

    Shape: token_logps (B, T) from `token_logprobs`; mask (B, T), 1 on response tokens.
    num_tokens: masked-in tokens of the *whole* optimizer batch for a token mean (1 for a token sum).
    """
    check_ndim("sft_loss", "token_logps", token_logps, 2, "(batch, seq_len)")
    check_same_shape("sft_loss", "token_logps", token_logps, mask=mask)
    if not isinstance(num_tokens, Tensor):
        check_positive("sft_loss", num_tokens=num_tokens)
    nll_sum = -masked_sum(token_logps, mask)
    loss = nll_sum / num_tokens
    count = masked_count(mask, dtype=token_logps.dtype)
    with torch.no_grad():
        stats = SFTStats(
            nll_sum=nll_sum.detach(),
            num_tokens=count,
            nll_per_token=nll_sum.detach() / count.clamp_min(1),
        )
    return loss, stats
