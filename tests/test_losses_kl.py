"""KL estimators k1/k2/k3, the KL-shaped PPO reward, and the KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.losses import (
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty_rewards,
)


def test_estimators_by_hand() -> None:
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    # log r = ref − logp = [−0.5, 1]
    assert kl_k1(logp, ref).tolist() == pytest.approx([0.5, -1.0])  # −log r
    assert kl_k2(logp, ref).tolist() == pytest.approx([0.125, 0.5])  # ½(log r)²
    # (r − 1) − log r: e^−0.5 − 1 + 0.5 = 0.106531; e − 1 − 1 = 0.718282
    assert kl_k3(logp, ref).tolist() == pytest.approx([0.106531, 0.718282], abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_is_never_negative(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(10_000, generator=g, dtype=torch.float64) * 10  # log-ratios up to ~±40
    tiny = torch.logspace(-8, -2, 200, dtype=torch.float64)
    log_r = torch.cat([wide, tiny, -tiny, torch.zeros(1, dtype=torch.float64)]).to(dtype)
    logp = torch.full_like(log_r, -3.0)
    k3 = kl_k3(logp, logp + log_r)
    assert k3.min().item() >= 0.0
    assert k3[-1].item() == 0.0  # policy = reference → 0
    # why expm1: the textbook exp(x) − 1 − x goes negative from rounding at tiny |x| in fp32
    if dtype == torch.float32:
        small = torch.cat([tiny, -tiny]).float()
        assert ((torch.exp(small) - 1 - small) < 0).any()


def test_k1_and_k3_are_unbiased_for_kl_policy_to_reference() -> None:
    g = torch.Generator().manual_seed(0)
    pi = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64)
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    true_kl = (pi * (pi / ref).log()).sum().item()
    # KL(π‖ref) = 0.5·ln2 + 0.4·ln0.8 + 0.1·ln0.4 = 0.346574 − 0.089257 − 0.091629 = 0.165687
    assert true_kl == pytest.approx(0.165687, abs=1e-6)
    samples = torch.multinomial(pi, 200_000, replacement=True, generator=g)  # tokens sampled from π
    for est in (kl_k1, kl_k3):
        values = est(pi.log()[samples], ref.log()[samples])
        stderr = values.std().item() / math.sqrt(values.numel())  # ~0.0013 (k1), ~0.0005 (k3)
        assert values.mean().item() == pytest.approx(true_kl, abs=4 * stderr), est.__name__


def test_kl_penalty_rewards_by_hand() -> None:
    scores = torch.tensor([1.0, -0.5])
    logp = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, stats = kl_penalty_rewards(scores, logp, ref, mask, kl_coef=0.1)
    # k1 row 0 = [0.5, −1, 0], row 1 = [0, 1, (pad)]; reward = −0.1·k1, score on the last kept token
    # row 0: [−0.05, 0.1, 0 + 1.0]; row 1: [0, −0.1 − 0.5, 0]
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 1.0], [0.0, -0.6, 0.0]]))
    f = stats.as_floats()
    # sequence KLs −0.5 and 1 → mean 0.25; non-score rewards 0.05, −0.1 → −0.025; scores mean 0.25
    assert f == pytest.approx({"kl": 0.25, "non_score_reward": -0.025, "score": 0.25}, abs=1e-7)
    # with k3 instead: row 0 log r = [−0.5, 1, 0] → k3 = [0.106531, 0.718282, 0]
    r3, _ = kl_penalty_rewards(scores, logp, ref, mask, kl_coef=0.1, estimator=KLEstimator.K3)
    assert r3[0].tolist() == pytest.approx([-0.0106531, -0.0718282, 1.0], abs=1e-6)


def test_kl_penalty_rewards_bad_input() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"rows \[1\] have no tokens in mask"):
        kl_penalty_rewards(torch.zeros(2), x, x, torch.tensor([[1, 0, 0], [0, 0, 0]]), kl_coef=0.1)
    with pytest.raises(ValueError, match=r"scores has shape \(3,\), expected \(2,\)"):
        kl_penalty_rewards(torch.zeros(3), x, x, torch.ones(2, 3), kl_coef=0.1)


def test_adaptive_kl_controller_by_hand() -> None:
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10_000)
    # KL 9 vs target 6: error clip(9/6 − 1 = 0.5) = 0.2 → β·(1 + 0.2·256/10000) = 0.2·1.00512 = 0.201024
    assert ctl.update(9.0, n_steps=256) == pytest.approx(0.201024, abs=1e-9)
    # KL 3: error clip(−0.5) = −0.2 → 0.201024·(1 − 0.00512) = 0.199995
    assert ctl.update(3.0, n_steps=256) == pytest.approx(0.19999476, abs=1e-8)
    # KL 6.6: error 0.1 (inside the clip) → 0.19999476·(1 + 0.1·1000/10000) = 0.19999476·1.01 = 0.20199471
    assert ctl.update(6.6, n_steps=1000) == pytest.approx(0.20199471, abs=1e-8)
    fresh = AdaptiveKLController(0.5, target=6.0, horizon=10_000)
    fresh.load_state_dict(ctl.state_dict())  # resume restores β
    assert fresh.value == ctl.value
    with pytest.raises(ValueError, match="target must be > 0, got 0"):
        AdaptiveKLController(0.2, target=0, horizon=10)


def test_fixed_kl_controller() -> None:
    ctl = FixedKLController(0.05)
    assert ctl.update(100.0, n_steps=512) == 0.05  # never moves
    assert ctl.state_dict() == {"value": 0.05}
