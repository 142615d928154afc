"""SFT masked cross-entropy, and its normalization under gradient accumulation."""

from __future__ import annotations

import pytest
import torch

from posttrain.losses import sft_loss

LOGPS = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -4.0, -0.25]], dtype=torch.float64)
MASK = torch.tensor([[0, 1, 1], [0, 1, 0]])  # prompt token first, then response; row 1 padded


def test_sft_loss_by_hand() -> None:
    loss, stats = sft_loss(LOGPS, MASK, num_tokens=3)
    # NLL over response tokens = 2 + 0.5 + 4 = 6.5, over 3 tokens → 2.166667
    assert loss.item() == pytest.approx(6.5 / 3, abs=1e-9)
    f = stats.as_floats()
    assert f == {"nll_sum": pytest.approx(6.5), "num_tokens": 3.0, "nll_per_token": pytest.approx(6.5 / 3)}
    # token sum: normalizer 1 → 6.5
    assert sft_loss(LOGPS, MASK, num_tokens=1)[0].item() == pytest.approx(6.5, abs=1e-9)


def test_sft_gradient_accumulation_equals_big_batch() -> None:
    full = LOGPS.clone().requires_grad_()
    sft_loss(full, MASK, num_tokens=3)[0].backward()
    micro = LOGPS.clone().requires_grad_()
    total = 0.0
    for i in range(2):  # two micro-batches of one row, same full-batch normalizer
        loss, _ = sft_loss(micro[i : i + 1], MASK[i : i + 1], num_tokens=3)
        loss.backward()
        total += loss.item()
    # 2.5/3 + 4/3 = 6.5/3 = 2.166667, and every response token gets gradient −1/3
    assert total == pytest.approx(6.5 / 3, abs=1e-9)
    torch.testing.assert_close(micro.grad, full.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(full.grad, -MASK.double() / 3, atol=1e-12, rtol=0)
    # the naive per-micro-batch mean is not the token mean: (2.5/2 + 4/1)/2 = 2.625 ≠ 2.166667
    naive = sum(sft_loss(LOGPS[i : i + 1], MASK[i : i + 1], num_tokens=int(MASK[i].sum()))[0].item()
                for i in range(2)) / 2
    assert naive == pytest.approx(2.625, abs=1e-9)
    assert abs(naive - total) > 0.4


def test_sft_bad_input() -> None:
    with pytest.raises(ValueError, match="num_tokens must be > 0, got 0"):
        sft_loss(LOGPS, MASK, num_tokens=0)
    with pytest.raises(ValueError, match=r"sft_loss: mask has shape \(2, 2\), expected \(2, 3\)"):
        sft_loss(LOGPS, MASK[:, :2], num_tokens=3)
