"""`torch.autograd.gradcheck` in fp64 on every differentiable objective of posttrain.losses.

Analytic gradients (autograd, and our hand-written backward of `token_logprobs`) must match central
finite differences. Inputs are random, so no point sits on a clip boundary or a max() tie.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from posttrain.losses import (
    bradley_terry_loss,
    clipped_value_loss,
    dpo_loss,
    entropy_bonus,
    entropy_from_logits,
    ipo_loss,
    kl_k1,
    kl_k2,
    kl_k3,
    kto_loss,
    loss_normalizer,
    orpo_loss,
    ppo_clip_loss,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    sequence_logprob_mean,
    sequence_logprob_sum,
    sft_loss,
    simpo_loss,
    token_logprobs,
    token_mean,
    value_loss,
)

G = torch.Generator().manual_seed(1234)


def rand(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=G, dtype=torch.float64) * scale + shift).requires_grad_()


def const(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(*shape, generator=G, dtype=torch.float64) * scale + shift


B, T, V = 3, 5, 7
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 1, 1, 0]])
TOKENS = torch.randint(0, V, (B, T), generator=G)
NORM = loss_normalizer(MASK, constant_length=T)
NEG = -torch.rand(B, generator=G, dtype=torch.float64) * 2 - 0.1  # length-normalized log-probs in (−2.1, −0.1)


# PPO: log-ratios spread over ±1, so tokens land on every branch (clipped low/high, unclipped, dual).
OLD = const(B, T, shift=-2)
ADV_NEG = -const(B, T).abs() - 0.1
OLD_V, RET = const(B, T), const(B, T)
MARGIN, WEIGHTS = const(4).abs(), const(4).abs()  # drawn once: a lambda must be a fixed function

CASES: dict[str, tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]] = {
    "token_logprobs": (lambda z: token_logprobs(z, TOKENS, chunk_size=4), (rand(B, T, V, scale=2),)),
    # causal-LM slicing: a non-contiguous view into the logits, tiles inside rows (chunk 3 < T − 1)
    "token_logprobs_sliced": (lambda z: token_logprobs(z[:, :-1], TOKENS[:, 1:], chunk_size=3),
                              (rand(B, T, V, scale=2),)),
    "entropy_from_logits": (lambda z: entropy_from_logits(z, chunk_size=4), (rand(B, T, V, scale=2),)),
    "entropy_from_logits_sliced": (lambda z: entropy_from_logits(z[:, :-1], chunk_size=3),
                                   (rand(B, T, V, scale=2),)),
    "sequence_logprob_sum": (lambda x: sequence_logprob_sum(x, MASK), (rand(B, T),)),
    "sequence_logprob_mean": (lambda x: sequence_logprob_mean(x, MASK), (rand(B, T),)),
    "sft_loss": (lambda x: sft_loss(x, MASK, num_tokens=11)[0], (rand(B, T, shift=-2),)),
    "bradley_terry_loss": (
        lambda c, r: bradley_terry_loss(c, r, margin=MARGIN, weights=WEIGHTS)[0],
        (rand(4), rand(4)),
    ),
    "dpo_loss": (lambda *x: dpo_loss(*x, beta=0.3, label_smoothing=0.1)[0],
                 (rand(B, shift=-20), rand(B, shift=-20), rand(B, shift=-20), rand(B, shift=-20))),
    "ipo_loss": (lambda *x: ipo_loss(*x, beta=0.3)[0],
                 (rand(B, shift=-20), rand(B, shift=-20), rand(B, shift=-20), rand(B, shift=-20))),
    "kto_loss": (
        lambda p, r: kto_loss(p, r, torch.tensor([True, False, True]), reference_point=0.2, beta=0.5,
                              desirable_weight=1.0, undesirable_weight=1.33)[0],
        (rand(B, shift=-20), rand(B, shift=-20)),
    ),
    "orpo_loss": (lambda c, r: orpo_loss(c, r, beta=0.2)[0],
                  (NEG.clone().requires_grad_(), (NEG - 0.3).requires_grad_())),
    "simpo_loss": (lambda c, r: simpo_loss(c, r, beta=2.0, gamma=0.5)[0],
                   (NEG.clone().requires_grad_(), (NEG - 0.3).requires_grad_())),
    "ppo_clip_loss": (
        lambda lp, a: ppo_clip_loss(lp, OLD, a, MASK, clip_low=0.2, clip_high=0.28)[0],
        ((OLD + const(B, T, scale=0.6)).requires_grad_(), rand(B, T)),
    ),
    "ppo_clip_loss_dual": (
        lambda lp: ppo_clip_loss(lp, OLD, ADV_NEG, MASK, clip_low=0.2, clip_high=0.28, dual_clip=1.5)[0],
        ((OLD + const(B, T, scale=0.8)).requires_grad_(),),
    ),
    "value_loss": (lambda v: value_loss(v, RET, MASK)[0], (rand(B, T),)),
    "clipped_value_loss": (
        lambda v: clipped_value_loss(v, OLD_V, RET, MASK, clip=0.2)[0],
        ((OLD_V + const(B, T, scale=0.4)).requires_grad_(),),
    ),
    "entropy_bonus": (lambda h: entropy_bonus(h, MASK, coef=0.01), (rand(B, T).abs().detach().requires_grad_(),)),
    "token_mean": (lambda x: token_mean(x, MASK, NORM), (rand(B, T),)),
    "seq_mean_token_mean": (lambda x: seq_mean_token_mean(x, MASK, NORM), (rand(B, T),)),
    "seq_mean_token_sum_norm": (lambda x: seq_mean_token_sum_norm(x, MASK, NORM), (rand(B, T),)),
    "kl_k1": (kl_k1, (rand(B, T, shift=-2), rand(B, T, shift=-2))),
    "kl_k2": (kl_k2, (rand(B, T, shift=-2), rand(B, T, shift=-2))),
    "kl_k3": (kl_k3, (rand(B, T, shift=-2), rand(B, T, shift=-2))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradcheck_fp64(name: str) -> None:
    fn, inputs = CASES[name]
    assert all(x.dtype == torch.float64 and x.requires_grad for x in inputs)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_ppo_inputs_cover_the_clip_branches() -> None:
    # guards the gradcheck above against testing only the unclipped branch
    (logp, adv) = CASES["ppo_clip_loss"][1]
    _, stats = ppo_clip_loss(logp, OLD, adv, MASK, clip_low=0.2, clip_high=0.28)
    assert stats.clip_frac_low.item() + stats.clip_frac_high.item() > 0
    (logp_dual,) = CASES["ppo_clip_loss_dual"][1]
    _, stats = ppo_clip_loss(logp_dual, OLD, ADV_NEG, MASK, clip_low=0.2, clip_high=0.28, dual_clip=1.5)
    assert stats.dual_clip_frac.item() > 0
