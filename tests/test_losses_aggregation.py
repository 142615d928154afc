"""Loss aggregation by hand, and the invariant: one batch of 8 (1×8) equals 8 micro-batches of 1 (8×1)."""

from __future__ import annotations

import pytest
import torch

from posttrain.losses import (
    AGGREGATIONS,
    Aggregation,
    AggregationFn,
    LossNormalizer,
    loss_normalizer,
    ppo_clip_loss,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    token_mean,
)

INF = float("inf")


def test_aggregations_by_hand() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, INF, -INF]])  # padding may hold anything, even ±inf
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    norm = loss_normalizer(mask, constant_length=4)
    assert norm == (4.0, 2.0, 4.0)  # 4 tokens, 2 sequences, L_max 4
    assert token_mean(loss, mask, norm).item() == pytest.approx(2.5)  # (1+2+3+4)/4
    assert seq_mean_token_mean(loss, mask, norm).item() == pytest.approx(3.0)  # (6/3 + 4/1)/2 = (2+4)/2
    assert seq_mean_token_sum_norm(loss, mask, norm).item() == pytest.approx(1.25)  # (6 + 4)/(2·4)
    assert set(AGGREGATIONS) == set(Aggregation)
    assert AGGREGATIONS[Aggregation("seq_mean_token_mean")] is seq_mean_token_mean


def test_aggregation_bad_input() -> None:
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="constant_length=None"):
        seq_mean_token_sum_norm(torch.zeros(2, 3), mask, loss_normalizer(mask))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 3\) has no tokens"):
        loss_normalizer(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"token_mean: mask has shape \(2, 3\), expected \(2, 4\)"):
        token_mean(torch.zeros(2, 4), mask, loss_normalizer(mask))


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """8 sequences, response lengths 1..16 (ragged on purpose), real PPO per-token losses."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 16, 3, 9, 2, 12, 5, 7])
    mask = (torch.arange(16)[None, :] < lengths[:, None]).long()  # (8, 16)
    old = torch.randn(8, 16, generator=g, dtype=torch.float64) - 2
    logp = old + 0.3 * torch.randn(8, 16, generator=g, dtype=torch.float64)
    adv = torch.randn(8, 1, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def _loss_and_grad(agg: AggregationFn, logp0: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                   mask: torch.Tensor, norm: LossNormalizer | None, rows: list[slice]) -> tuple[float, torch.Tensor]:
    """Accumulate `agg` over the given micro-batches of rows, as a training loop would."""
    logp = logp0.clone().requires_grad_()  # the "parameter": one log-prob per token
    total = 0.0
    for r in rows:
        per_token, _ = ppo_clip_loss(logp[r], old[r], adv[r], mask[r], clip_low=0.2, clip_high=0.28)
        loss = agg(per_token, mask[r], norm if norm is not None else loss_normalizer(mask[r], constant_length=16))
        loss.backward()
        total += loss.item()
    return total, logp.grad


@pytest.mark.parametrize("mode", list(Aggregation))
def test_one_by_eight_equals_eight_by_one(mode: Aggregation) -> None:
    agg = AGGREGATIONS[mode]
    logp, old, adv, mask = _batch()
    norm = loss_normalizer(mask, constant_length=16)  # counted once over the FULL batch: 55 tokens, 8 seqs
    full, full_grad = _loss_and_grad(agg, logp, old, adv, mask, norm, [slice(0, 8)])
    micro, micro_grad = _loss_and_grad(agg, logp, old, adv, mask, norm, [slice(i, i + 1) for i in range(8)])
    assert abs(full) > 1e-3  # a non-trivial loss
    assert micro == pytest.approx(full, abs=1e-12)
    torch.testing.assert_close(micro_grad, full_grad, atol=1e-12, rtol=0)


def test_naive_micro_batch_mean_is_not_the_token_mean() -> None:
    logp, old, adv, mask = _batch()
    norm = loss_normalizer(mask, constant_length=16)
    full, full_grad = _loss_and_grad(token_mean, logp, old, adv, mask, norm, [slice(0, 8)])
    # naive: each micro-batch divides by ITS OWN token count, then the 8 results are averaged
    naive, naive_grad = _loss_and_grad(lambda *a: token_mean(*a) / 8, logp, old, adv, mask, None,
                                       [slice(i, i + 1) for i in range(8)])
    # a token of the 1-token sequence weighs 1/8 instead of 1/55 (6.9× too much), one of the 16-token
    # sequence 1/(8·16) instead of 1/55 (0.43×): long answers are under-weighted
    assert abs(naive - full) > 0.01
    ratio = naive_grad[0, 0] / full_grad[0, 0]  # sequence 0 has 1 token
    assert ratio.item() == pytest.approx(55 / 8, rel=1e-9)  # (1/8)/(1/55) = 6.875
    ratio_long = naive_grad[1, 0] / full_grad[1, 0]  # sequence 1 has 16 tokens
    assert ratio_long.item() == pytest.approx(55 / (8 * 16), rel=1e-9)  # (1/(8·16))/(1/55) = 0.4297


@pytest.mark.parametrize("mode", [Aggregation.SEQ_MEAN_TOKEN_MEAN, Aggregation.SEQ_MEAN_TOKEN_SUM_NORM])
def test_naive_mean_happens_to_match_for_sequence_modes(mode: Aggregation) -> None:
    # With equal-sized micro-batches (1 sequence each) the sequence-normalized modes are equal even when
    # naively averaged: the contrast that makes token_mean's trap easy to miss.
    agg = AGGREGATIONS[mode]
    logp, old, adv, mask = _batch()
    full, _ = _loss_and_grad(agg, logp, old, adv, mask, loss_normalizer(mask, constant_length=16), [slice(0, 8)])
    naive, _ = _loss_and_grad(lambda *a: agg(*a) / 8, logp, old, adv, mask, None,
                              [slice(i, i + 1) for i in range(8)])
    assert naive == pytest.approx(full, abs=1e-12)
