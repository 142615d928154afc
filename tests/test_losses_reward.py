"""Bradley–Terry reward-model loss and ranking → pairs expansion (InstructGPT weighting)."""

from __future__ import annotations

import pytest
import torch

from posttrain.losses import bradley_terry_loss, rankings_to_pairs


def test_bradley_terry_by_hand() -> None:
    chosen = torch.tensor([2.0, 0.0], dtype=torch.float64)
    rejected = torch.tensor([1.0, 0.0], dtype=torch.float64)
    loss, stats = bradley_terry_loss(chosen, rejected)
    # −log σ(1) = 0.313262, −log σ(0) = ln 2 = 0.693147; mean = 0.503204
    assert loss.item() == pytest.approx(0.503204, abs=1e-6)
    f = stats.as_floats()
    assert f["accuracy"] == 0.5  # 2 > 1 yes, 0 > 0 no
    assert f["margin"] == pytest.approx(0.5)  # (1 + 0) / 2
    assert f["chosen_reward"] == pytest.approx(1.0) and f["rejected_reward"] == pytest.approx(0.5)


def test_bradley_terry_margin() -> None:
    chosen = torch.tensor([2.0, 0.0], dtype=torch.float64)
    rejected = torch.tensor([1.0, 0.0], dtype=torch.float64)
    loss, _ = bradley_terry_loss(chosen, rejected, margin=1.0)
    # diff − m = [0, −1]: ln 2 = 0.693147, log(1 + e) = 1.313262; mean = 1.003204
    assert loss.item() == pytest.approx(1.003204, abs=1e-6)
    loss_t, _ = bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, 0.0], dtype=torch.float64))
    # per-pair margin [1, 0]: diff − m = [0, 0] → ln 2 each
    assert loss_t.item() == pytest.approx(0.693147, abs=1e-6)


def test_rankings_to_pairs() -> None:
    pairs = rankings_to_pairs([[2, 0, 1], [1, 0]])
    # ranking 0 (K=3): (2,0), (2,1), (0,1), weight 1/C(3,2) = 1/3 each; ranking 1 offset by 3: (3+1, 3+0), weight 1
    assert pairs.chosen.tolist() == [2, 2, 0, 4]
    assert pairs.rejected.tolist() == [0, 1, 1, 3]
    torch.testing.assert_close(pairs.weights, torch.tensor([1 / 3, 1 / 3, 1 / 3, 1.0]))
    # K = 4 → 6 pairs of weight 1/6; each ranking sums to 1
    four = rankings_to_pairs([[3, 1, 0, 2]])
    assert len(four.chosen) == 6 and four.weights.sum().item() == pytest.approx(1.0)


def test_each_ranking_counts_once() -> None:
    rewards = torch.tensor([1.0, 0.0, 3.0, 0.5, 0.5], dtype=torch.float64)  # responses of both rankings
    pairs = rankings_to_pairs([[2, 0, 1], [1, 0]])
    loss, stats = bradley_terry_loss(rewards[pairs.chosen], rewards[pairs.rejected],
                                     weights=pairs.weights.double())
    # ranking 0 diffs 2, 3, 1: (0.126928 + 0.048587 + 0.313262)/3 = 0.162926; ranking 1 diff 0: ln 2 = 0.693147
    # two rankings, each counted once: (0.162926 + 0.693147)/2 = 0.428036
    assert loss.item() == pytest.approx(0.428036, abs=1e-6)
    assert stats.as_floats()["accuracy"] == pytest.approx(0.5)  # (1/3·3 correct + 1·0)/2
    # split into micro-batches by ranking: normalizer = 2 rankings of the full batch
    a, _ = bradley_terry_loss(rewards[pairs.chosen[:3]], rewards[pairs.rejected[:3]],
                              weights=pairs.weights[:3].double(), normalizer=2.0)
    b, _ = bradley_terry_loss(rewards[pairs.chosen[3:]], rewards[pairs.rejected[3:]],
                              weights=pairs.weights[3:].double(), normalizer=2.0)
    # equal up to the fp32 rounding of the weights 1/3 (their sum is 2 ± 1e-7, the default normalizer)
    assert (a + b).item() == pytest.approx(loss.item(), abs=1e-7)


def test_bad_rankings_and_shapes() -> None:
    with pytest.raises(ValueError, match=r"ranking 1 is \[0, 0, 1\], expected a permutation of 0..2"):
        rankings_to_pairs([[0, 1], [0, 0, 1]])
    with pytest.raises(ValueError, match="ranking 0 has 1 response"):
        rankings_to_pairs([[0]])
    with pytest.raises(ValueError, match=r"rejected_rewards has shape \(3,\), expected \(2,\)"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))
