"""The DPO family, by hand: DPO (+ label smoothing), IPO, KTO, ORPO, SimPO, and the method table."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from posttrain.losses import (
    PREFERENCE_METHODS,
    KTOStats,
    ORPOStats,
    PreferenceLoss,
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    simpo_loss,
)

LN2 = math.log(2)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# One pair used throughout: policy (−10, −12), reference (−11, −11) → log-ratios +1 (chosen), −1 (rejected).
PC, PR, RC, RR = t(-10.0), t(-12.0), t(-11.0), t(-11.0)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
def test_dpo_is_ln2_when_policy_equals_reference(label_smoothing: float) -> None:
    logps_c, logps_r = t(-3.0, -50.0, -7.5), t(-9.0, -1.0, -7.5)
    loss, stats = dpo_loss(logps_c, logps_r, logps_c.clone(), logps_r.clone(), beta=0.1,
                           label_smoothing=label_smoothing)
    # h = 0 → −(1−ε)·log σ(0) − ε·log σ(0) = ln 2 = 0.693147 whatever ε
    assert loss.item() == pytest.approx(LN2, abs=1e-12)
    f = stats.as_floats()
    assert f["margin"] == 0.0 and f["accuracy"] == 0.0  # rewards 0 and 0: no pair strictly preferred


def test_dpo_by_hand() -> None:
    pc = PC.clone().requires_grad_()
    loss, stats = dpo_loss(pc, PR, RC, RR, beta=0.5)
    # h = 1 − (−1) = 2, β·h = 1 → −log σ(1) = 0.313262
    assert loss.item() == pytest.approx(0.313262, abs=1e-6)
    loss.backward()
    # ∂/∂π_c = −β·σ(−β·h) = −0.5·0.268941 = −0.134471: raising the chosen log-prob lowers the loss
    assert pc.grad.item() == pytest.approx(-0.134471, abs=1e-6)
    f = stats.as_floats()
    # rewards β·(π − ref): 0.5·1 = 0.5 and 0.5·(−1) = −0.5; raw log-probs reported as passed
    assert f == {"chosen_rewards": 0.5, "rejected_rewards": -0.5, "margin": 1.0, "accuracy": 1.0,
                 "chosen_logps": -10.0, "rejected_logps": -12.0}


def test_dpo_label_smoothing_by_hand() -> None:
    loss, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.1)
    # 0.9·(−log σ(1)) + 0.1·(−log σ(−1)) = 0.9·0.313262 + 0.1·1.313262 = 0.413262
    assert loss.item() == pytest.approx(0.413262, abs=1e-6)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\), got 0.5"):
        dpo_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.5)


def test_dpo_normalizer_for_micro_batches() -> None:
    pc, pr, rc, rr = t(-1.0, -2.0, -3.0), t(-2.0, -2.0, -1.0), t(-1.5, -2.0, -2.0), t(-1.0, -2.5, -1.0)
    full, _ = dpo_loss(pc, pr, rc, rr, beta=0.3)  # mean over 3 pairs
    parts = dpo_loss(pc[:1], pr[:1], rc[:1], rr[:1], beta=0.3, normalizer=3)[0] + \
        dpo_loss(pc[1:], pr[1:], rc[1:], rr[1:], beta=0.3, normalizer=3)[0]
    assert parts.item() == pytest.approx(full.item(), abs=1e-12)  # (ℓ0)/3 + (ℓ1 + ℓ2)/3 = mean


def test_ipo_by_hand() -> None:
    loss, stats = ipo_loss(PC, PR, RC, RR, beta=0.5)
    # h = 2, target 1/(2·0.5) = 1 → (2 − 1)² = 1
    assert loss.item() == pytest.approx(1.0, abs=1e-12)
    # β = 0.25: target 1/(2·0.25) = 2 = h → 0
    assert ipo_loss(PC, PR, RC, RR, beta=0.25)[0].item() == pytest.approx(0.0, abs=1e-12)
    # policy = reference: h = 0 → (0 − 1)² = 1 at β = 0.5
    assert ipo_loss(PC, PR, PC, PR, beta=0.5)[0].item() == pytest.approx(1.0, abs=1e-12)
    assert stats.as_floats()["margin"] == pytest.approx(1.0)  # β·1 − β·(−1) = 0.5 + 0.5


def test_kto_by_hand() -> None:
    loss, stats = kto_loss(t(-10.0, -12.0), t(-11.0, -11.0), torch.tensor([True, False]),
                           reference_point=0.5, beta=1.0, desirable_weight=1.0, undesirable_weight=2.0)
    # r = [1, −1], z0 = 0.5
    # desirable:   λ_D·σ(−β(r − z0)) = σ(−0.5)     = 0.377541
    # undesirable: λ_U·σ(−β(z0 − r)) = 2·σ(−1.5)   = 2·0.182426 = 0.364851
    # mean = (0.377541 + 0.364851)/2 = 0.371196
    assert loss.item() == pytest.approx(0.371196, abs=1e-6)
    assert isinstance(stats, KTOStats)
    f = stats.as_floats()
    assert f["chosen_rewards"] == 1.0 and f["rejected_rewards"] == -1.0 and f["margin"] == 2.0
    assert f["accuracy"] == 1.0  # 1 > 0.5 (desirable) and −1 < 0.5 (undesirable)
    assert f["reference_point"] == 0.5 and f["num_desirable"] == 1.0 and f["num_undesirable"] == 1.0


def test_kto_anchor_and_reference_point() -> None:
    logps = t(-3.0, -4.0, -5.0)
    loss, _ = kto_loss(logps, logps.clone(), torch.tensor([True, True, False]), reference_point=0.0,
                       beta=0.1, desirable_weight=1.0, undesirable_weight=1.5)
    # r = z0 = 0 → each λ_y·σ(0): (0.5 + 0.5 + 1.5·0.5)/3 = 1.75/3 = 0.583333
    assert loss.item() == pytest.approx(1.75 / 3, abs=1e-12)
    # z0 = max(0, mean(π − ref)): [1, −2] → mean −0.5 → 0; [1, 2] → 1.5
    assert kto_reference_point(t(-5.0, -7.0), t(-6.0, -5.0)).item() == 0.0
    assert kto_reference_point(t(-5.0, -7.0), t(-6.0, -9.0)).item() == pytest.approx(1.5)
    p = t(-5.0).requires_grad_()
    assert not kto_reference_point(p, t(-6.0)).requires_grad  # z0 carries no gradient


def test_kto_only_one_class_present() -> None:
    _, stats = kto_loss(t(-1.0, -2.0), t(-1.5, -1.5), torch.tensor([True, True]), reference_point=0.0, beta=1.0)
    f = stats.as_floats()
    # rewards 0.5, −0.5 → desirable mean 0; no undesirable example → reported 0
    assert f["chosen_rewards"] == 0.0 and f["rejected_rewards"] == 0.0 and f["num_undesirable"] == 0.0
    with pytest.raises(ValueError, match="desirable must be a bool tensor"):
        kto_loss(t(-1.0), t(-1.0), torch.tensor([1]), reference_point=0.0, beta=1.0)


def test_orpo_by_hand() -> None:
    loss, stats = orpo_loss(t(math.log(0.5)), t(math.log(0.2)), beta=0.1)
    # p_c = 0.5: odds 1, log-odds 0; p_r = 0.2: odds 0.25, log-odds −1.386294 → ratio 1.386294
    # −log σ(1.386294) = ln(1 + 0.25) = 0.223144; NLL = −ln 0.5 = 0.693147
    # loss = 0.693147 + 0.1·0.223144 = 0.715461
    assert loss.item() == pytest.approx(0.715461, abs=1e-6)
    assert isinstance(stats, ORPOStats)
    f = stats.as_floats()
    assert f["log_odds_ratio"] == pytest.approx(1.386294, abs=1e-6) and f["nll"] == pytest.approx(0.693147, abs=1e-6)


def test_orpo_log_odds_stable_near_certainty() -> None:
    # mean log-prob −1e-9 (p → 1): log(1 − p) = log(1e-9) = −20.723266; log-odds = −1e-9 + 20.723266
    loss, stats = orpo_loss(t(-1e-9), t(-1.0), beta=1.0)
    # rejected p = e^−1: log-odds = −1 − ln(1 − e^−1) = −1 + 0.458675 = −0.541325 → ratio 21.264591
    assert stats.as_floats()["log_odds_ratio"] == pytest.approx(21.264591, abs=1e-5)
    assert math.isfinite(loss.item())


def test_simpo_by_hand() -> None:
    loss, stats = simpo_loss(t(-0.5), t(-1.5), beta=2.0, gamma=0.5)
    # β·ℓ_c − β·ℓ_r − γ = −1 + 3 − 0.5 = 1.5 → −log σ(1.5) = 0.201413
    assert loss.item() == pytest.approx(0.201413, abs=1e-6)
    f = stats.as_floats()
    assert f["chosen_rewards"] == -1.0 and f["rejected_rewards"] == -3.0 and f["margin"] == 2.0


def test_method_table_matches_signatures() -> None:
    assert set(PREFERENCE_METHODS) == set(PreferenceLoss)
    for name, method in PREFERENCE_METHODS.items():
        params = inspect.signature(method.loss_fn).parameters
        assert method.uses_reference == any(p.startswith("ref_") for p in params), name
        assert method.paired == ("policy_chosen_logps" in params), name
    # the input convention each paper defines
    assert [m for m, s in PREFERENCE_METHODS.items() if s.length_normalized] == [PreferenceLoss.ORPO,
                                                                                 PreferenceLoss.SIMPO]
    assert PreferenceLoss("dpo") is PreferenceLoss.DPO and str(PreferenceLoss.SIMPO) == "simpo"


def test_preference_bad_input() -> None:
    with pytest.raises(ValueError, match=r"dpo_loss: ref_rejected_logps has shape \(2,\), expected \(1,\)"):
        dpo_loss(PC, PR, RC, t(-1.0, -2.0), beta=0.1)
    with pytest.raises(ValueError, match="simpo_loss: beta must be > 0, got 0"):
        simpo_loss(PC, PR, beta=0, gamma=0.5)
