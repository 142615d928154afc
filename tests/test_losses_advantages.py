"""GAE, group advantages (GRPO, Dr. GRPO, RLOO), whitening, REINFORCE++ — by hand and by anchor."""

from __future__ import annotations

import pytest
import torch

from posttrain.losses import (
    discounted_returns,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
)


def f64(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_by_hand() -> None:
    rewards, values, mask = f64([[0.0, 0.0, 1.0]]), f64([[0.5, 0.6, 0.7]]), torch.ones(1, 3)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=2: δ = 1 + 0.9·0 − 0.7 = 0.3                  A = 0.3
    # t=1: δ = 0 + 0.9·0.7 − 0.6 = 0.03              A = 0.03 + 0.72·0.3 = 0.246
    # t=0: δ = 0 + 0.9·0.6 − 0.5 = 0.04              A = 0.04 + 0.72·0.246 = 0.21712
    assert adv[0].tolist() == pytest.approx([0.21712, 0.246, 0.3], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([0.71712, 0.846, 1.0], abs=1e-12)  # A + V


def test_gae_lambda1_gamma1_is_reward_to_go_minus_value() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 12, generator=g, dtype=torch.float64)
    values = torch.randn(5, 12, generator=g, dtype=torch.float64)
    lengths = torch.tensor([12, 1, 7, 3, 10])
    mask = torch.arange(12)[None] < lengths[:, None]  # right padding
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    kept_rewards = torch.where(mask, rewards, 0.0)
    reward_to_go = kept_rewards.flip(-1).cumsum(-1).flip(-1)  # Σ_{s ≥ t} r_s
    torch.testing.assert_close(adv, torch.where(mask, reward_to_go - values, 0.0), atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, torch.where(mask, reward_to_go, 0.0), atol=1e-12, rtol=0)
    # by hand for row 1 (one token): A = r − V
    assert adv[1, 0].item() == pytest.approx((rewards[1, 0] - values[1, 0]).item(), abs=1e-12)


def test_gae_skips_masked_positions_inside_a_response() -> None:
    rewards, values = f64([[0.0, 0.0, 1.0]]), f64([[0.5, 0.6, 0.7]])
    compact, _ = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # the same three steps with garbage interleaved (e.g. tool output tokens) and trailing padding
    spread_r = f64([[0.0, 50.0, 0.0, 1.0, -7.0]])
    spread_v = f64([[0.5, 9.0, 0.6, 0.7, 3.0]])
    spread_m = torch.tensor([[1, 0, 1, 1, 0]])
    adv, ret = gae(spread_r, spread_v, spread_m, gamma=0.9, lam=0.8)
    assert adv[0].tolist() == pytest.approx([0.21712, 0.0, 0.246, 0.3, 0.0], abs=1e-12)
    assert adv[0, [0, 2, 3]].tolist() == pytest.approx(compact[0].tolist(), abs=1e-12)
    assert ret[0, 1].item() == 0.0 and ret[0, 4].item() == 0.0


def test_gae_outputs_are_detached_and_checked() -> None:
    v = torch.zeros(1, 2, requires_grad=True)
    adv, ret = gae(torch.ones(1, 2), v, torch.ones(1, 2), gamma=1.0, lam=0.95)
    assert not adv.requires_grad and not ret.requires_grad
    with pytest.raises(ValueError, match=r"gae: lam must be in \[0, 1\], got 1.5"):
        gae(torch.ones(1, 2), v, torch.ones(1, 2), gamma=1.0, lam=1.5)
    with pytest.raises(ValueError, match=r"gae: values has shape \(1, 3\), expected \(1, 2\)"):
        gae(torch.ones(1, 2), torch.zeros(1, 3), torch.ones(1, 2), gamma=1.0, lam=1.0)


def test_discounted_returns_by_hand() -> None:
    # γ = 0.5: G_2 = 4, G_1 = 2 + 0.5·4 = 4, G_0 = 1 + 0.5·4 = 3
    out = discounted_returns(f64([[1.0, 2.0, 4.0, 99.0]]), torch.tensor([[1, 1, 1, 0]]), gamma=0.5)
    assert out[0].tolist() == pytest.approx([3.0, 4.0, 4.0, 0.0], abs=1e-12)


REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)  # 2 prompts × G=4


def test_grpo_advantages_by_hand() -> None:
    adv = grpo_advantages(REWARDS, group_size=4)
    # group 0: mean 0.5, unbiased std √((4·0.25)/3) = 0.5773503 → ±0.5/(0.5773503 + 1e-6 eps) = ±0.8660239
    # group 1: all equal → 0 (the anchor: no signal from a prompt every sample solved)
    expected = [0.8660239, -0.8660239, 0.8660239, -0.8660239, 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize("value", [0.0, 1.0, -3.5, 1e6])
def test_group_advantages_zero_for_equal_rewards(value: float) -> None:
    r = torch.full((6,), value, dtype=torch.float64)
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        assert fn(r, group_size=3).abs().max().item() == 0.0, fn.__name__


def test_dr_grpo_and_rloo_by_hand() -> None:
    # Dr. GRPO: r − mean = ±0.5; group 1 → 0
    assert dr_grpo_advantages(REWARDS, group_size=4).tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0])
    # RLOO: 1 − (0+1+0)/3 = 0.666667; 0 − (1+1+0)/3 = −0.666667 (= 4/3 · ±0.5)
    assert rloo_advantages(REWARDS, group_size=4).tolist() == pytest.approx(
        [2 / 3, -2 / 3, 2 / 3, -2 / 3, 0, 0, 0, 0], abs=1e-12)


def test_group_bad_input() -> None:
    with pytest.raises(ValueError, match="7 rewards do not split into groups of 4"):
        grpo_advantages(torch.zeros(7), group_size=4)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        rloo_advantages(torch.zeros(4), group_size=1)


def test_masked_whiten_by_hand() -> None:
    x = f64([[1.0, 2.0, 3.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # mean 2.5, unbiased var (2.25+0.25+0.25+2.25)/3 = 1.666667, std 1.290994
    out = masked_whiten(x, mask)
    assert out[0].tolist() == pytest.approx([-1.161895, -0.387298, 0.387298, 1.161895, 0.0], abs=1e-6)
    # shift_mean=False adds the mean back: + 2.5
    kept = masked_whiten(x, mask, shift_mean=False)
    assert kept[0].tolist() == pytest.approx([1.338105, 2.112702, 2.887298, 3.661895, 0.0], abs=1e-6)
    with pytest.raises(ValueError, match="at least 2 masked-in elements"):
        masked_whiten(x, torch.tensor([[1, 0, 0, 0, 0]]))


def test_reinforce_pp_by_hand() -> None:
    rewards = f64([[-0.1, -0.1, 1.0], [-0.1, 0.5, 7.0]])  # −β·KL per token, score at the last token
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = reinforce_pp_advantages(rewards, mask)
    # returns-to-go (γ = 1): row 0 [0.8, 0.9, 1.0], row 1 [0.4, 0.5]
    # global mean 3.6/5 = 0.72; unbiased var 0.268/4 = 0.067; std 0.258844
    expected = [[0.309067, 0.695401, 1.081734], [-1.236268, -0.849934, 0.0]]
    torch.testing.assert_close(adv, f64(expected), atol=1e-6, rtol=0)
