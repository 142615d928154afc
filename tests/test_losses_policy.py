"""PPO clipped surrogate (clip-higher, dual clip), value losses, entropy bonus — by hand."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.losses import clipped_value_loss, entropy_bonus, ppo_clip_loss, value_loss

E = math.e
# One row of 7 tokens; the last is padding holding a garbage log-prob.
LOG_RATIO = [0.5, 0.5, 1.0, -0.5, -0.5, 0.0, 1000.0]
ADV = [1.0, -1.0, -1.0, -1.0, 1.0, 2.0, 1.0]
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])


def _run(dual_clip: float | None) -> tuple[list[float], list[float], dict[str, float]]:
    old = torch.full((1, 7), -2.0, dtype=torch.float64)
    logp = (old + torch.tensor([LOG_RATIO], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([ADV], dtype=torch.float64)
    loss, stats = ppo_clip_loss(logp, old, adv, MASK, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    loss.sum().backward()
    return loss.detach()[0].tolist(), logp.grad[0].tolist(), stats.as_floats()


def test_ppo_clip_by_hand() -> None:
    loss, grad, stats = _run(dual_clip=None)
    expected_loss = [
        -1.28,  # r = e^0.5 = 1.6487, A = +1 → clipped at 1 + 0.28 → −1.28·A
        1.648721,  # r = 1.6487, A = −1 → pessimistic branch −r·A = 1.6487 (not clipped)
        E,  # r = e = 2.718282, A = −1 → −r·A = 2.718282
        0.8,  # r = e^−0.5 = 0.6065, A = −1 → clipped at 1 − 0.2 → −0.8·A = 0.8
        -0.606531,  # r = 0.6065, A = +1 → −r·A (the min picks the unclipped term)
        -2.0,  # r = 1, A = 2 → −2
        0.0,  # padding: masked out, and its log-ratio 1000 never reaches exp()
    ]
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    # ∂(−r·A)/∂log π = −r·A on unclipped tokens; zero on clipped tokens (0 and 3) and on padding
    assert grad == pytest.approx([0.0, 1.648721, E, 0.0, -0.606531, -2.0, 0.0], abs=1e-6)
    assert all(math.isfinite(g) for g in grad)
    assert stats["clip_frac_low"] == pytest.approx(1 / 6)  # token 3
    assert stats["clip_frac_high"] == pytest.approx(1 / 6)  # token 0
    assert stats["dual_clip_frac"] == 0.0
    # (1.648721·2 + 2.718282 + 0.606531·2 + 1)/6 = 8.228786/6 = 1.371464
    assert stats["ratio_mean"] == pytest.approx(1.371464, abs=1e-6)
    assert stats["ratio_max"] == pytest.approx(E, abs=1e-6)  # padding's e^1000 is not a ratio
    # k3 = r − 1 − log r: 2·0.148721 + 0.718282 + 2·0.106531 + 0 = 1.228786, /6 = 0.204798
    assert stats["approx_kl"] == pytest.approx(0.204798, abs=1e-6)


def test_ppo_gradient_is_zero_on_clipped_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4, 16, generator=g, dtype=torch.float64) - 3
    logp = (old + torch.randn(4, 16, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    adv = torch.randn(4, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 16)
    loss, stats = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss.sum().backward()
    r = (logp - old).exp().detach()
    clipped = ((r > 1.2) & (adv > 0)) | ((r < 0.8) & (adv < 0))
    assert 4 <= clipped.sum() <= 60  # the draw does clip some tokens and not others
    assert torch.all(logp.grad[clipped] == 0)
    assert torch.all(logp.grad[~clipped] != 0)
    # the two clip fractions add up to the clipped share
    assert stats.clip_frac_low.item() + stats.clip_frac_high.item() == pytest.approx(clipped.double().mean().item())


def test_ppo_dual_clip_by_hand() -> None:
    loss, grad, stats = _run(dual_clip=2.0)
    # token 2: r = e = 2.718 > c = 2, A = −1 → loss capped at −c·A = 2, gradient 0
    # token 1: r = 1.6487 < c → unchanged 1.648721
    assert loss[1] == pytest.approx(1.648721, abs=1e-6) and loss[2] == pytest.approx(2.0, abs=1e-12)
    assert grad[2] == 0.0 and grad[1] == pytest.approx(1.648721, abs=1e-6)
    assert stats["dual_clip_frac"] == pytest.approx(1 / 6)


def test_ppo_sequence_advantages_broadcast() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0], [-1.0]], dtype=torch.float64)  # (B, 1): one advantage per sequence (GRPO)
    loss, _ = ppo_clip_loss(logp, logp.clone(), adv, torch.ones(2, 2), clip_low=0.2, clip_high=0.2)
    # r = 1 everywhere → −A per token
    assert loss.tolist() == [[-2.0, -2.0], [1.0, 1.0]]


def test_ppo_bad_input() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\), expected \(2, 3\) or \(2, 1\)"):
        ppo_clip_loss(x, x, torch.zeros(3), x, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="dual_clip must be > 1, got 0.5"):
        ppo_clip_loss(x, x, x, x, clip_low=0.2, clip_high=0.2, dual_clip=0.5)
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(2, 2\), expected \(2, 3\)"):
        ppo_clip_loss(x, x[:, :2], x, x, clip_low=0.2, clip_high=0.2)


def test_value_losses_by_hand() -> None:
    values = torch.tensor([[1.2, 2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.8, 1.5, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 0.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = clipped_value_loss(values, old, returns, mask, clip=0.2)
    # tok 0: V clipped to 0.8 + 0.2 = 1.0; ½·max((1.2−2)², (1.0−2)²) = ½·max(0.64, 1.0) = 0.5
    # tok 1: V clipped to 1.7;           ½·max((2−0)², (1.7−0)²)   = ½·max(4, 2.89) = 2.0
    # tok 2: masked → 0
    assert loss.detach()[0].tolist() == pytest.approx([0.5, 2.0, 0.0], abs=1e-12)
    loss.sum().backward()
    # tok 0 took the saturated clipped branch → 0; tok 1: V − R = 2
    assert values.grad[0].tolist() == pytest.approx([0.0, 2.0, 0.0], abs=1e-12)
    f = stats.as_floats()
    # clip_frac: 1 of 2; mse (0.64 + 4)/2 = 2.32; value_mean (1.2 + 2)/2 = 1.6
    assert f == pytest.approx({"clip_frac": 0.5, "mse": 2.32, "value_mean": 1.6}, abs=1e-12)
    plain, _ = value_loss(values, returns, mask)
    # ½·0.64 = 0.32, ½·4 = 2
    assert plain.detach()[0].tolist() == pytest.approx([0.32, 2.0, 0.0], abs=1e-12)


def test_entropy_bonus_by_hand() -> None:
    h = torch.tensor([[1.0, 2.0, 3.0]])
    # −0.01·[1, 2] on kept tokens, 0 on padding
    assert entropy_bonus(h, torch.tensor([[1, 1, 0]]), coef=0.01)[0].tolist() == pytest.approx([-0.01, -0.02, 0.0])
