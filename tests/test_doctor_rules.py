"""Each doctor rule on synthetic streams at and around its threshold: fires, fires at the right
severity, stays silent. Numbers are chosen so the arithmetic can be checked by hand (comments)."""

from __future__ import annotations

import math

import pytest

from posttrain.doctor import Severity, StageStream
from posttrain.doctor.rules_numeric import grad_spike, non_finite, ratio_mismatch
from posttrain.doctor.rules_preference import likelihood_displacement, reward_scale_collapse
from posttrain.doctor.rules_rl import (clip_fraction_climb, difficulty_mismatch, entropy_collapse, entropy_fit,
                                       length_explosion, reward_overoptimization, verifier_gaming)
from posttrain.doctor.rules_sft import forgetting, overfitting
from posttrain.doctor.stats import noise, theil_sen
from posttrain.doctor.streams import EvalRow, RunStreams, Series


def stream(kind: str, steps: list[int] | None = None, config: dict | None = None, **curves: list[float]) -> StageStream:
    """A stage whose records carry `curves` (metric names with '__' for '/') at `steps` (default 1..n)."""
    n = max(len(v) for v in curves.values())
    steps = steps or list(range(1, n + 1))
    recs = [{"stage": kind, "step": s} for s in steps]
    for name, values in curves.items():
        for r, v in zip(recs, values):
            if v is not None:
                r[name.replace("__", "/")] = v
    return StageStream(kind, kind, config or {}, recs)


def sev(findings) -> Severity | None:
    assert len(findings) <= 1
    return findings[0].severity if findings else None


# ---- statistics ------------------------------------------------------------------------------------
def test_noise_and_slope_by_hand():
    # x = 0, 1, 0, 1, 0, 1, 0, 1: second differences −2, 2, −2, 2, −2, 2 → median 0, MAD 2 → σ = 2.9652 → /√6 = 1.2105
    assert noise([0, 1, 0, 1, 0, 1, 0, 1]) == pytest.approx(1.4826 * 2 / math.sqrt(6))
    # a straight line (a loss falling steadily) has no noise: its second differences are 0
    assert noise([5.0 - 0.3 * i for i in range(10)]) == pytest.approx(0.0, abs=1e-12)
    # a line 2·t + 1 with one outlier: Theil–Sen still reads slope 2
    assert theil_sen([0, 1, 2, 3, 4, 5], [1, 3, 5, 100, 9, 11]) == pytest.approx(2.0)


# ---- SFT -------------------------------------------------------------------------------------------
EVAL_STEPS = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
TRAIN = [2.0 - 0.15 * i for i in range(10)]  # train loss falls 2.0 → 0.65 throughout


@pytest.mark.parametrize("tail, expected", [
    # minimum 1.45 at step 50; end = median of the last two; floor = 3% of 1.45 = 0.0435 (noise is smaller)
    ([1.47, 1.50, 1.55, 1.60, 1.65], Severity.CRITICAL),  # end 1.625: +0.175 = 12% ≥ 10%
    ([1.46, 1.48, 1.50, 1.52, 1.53], Severity.WARNING),   # end 1.525: +0.075 = 5.2%
    ([1.46, 1.47, 1.47, 1.47, 1.48], None),               # end 1.475: +0.025 < 0.0435
])
def test_overfitting_threshold(tail, expected):
    s = stream("sft", EVAL_STEPS, **{"eval__loss": [2.0, 1.8, 1.6, 1.5, 1.45] + tail, "loss__sft": TRAIN})
    f = overfitting(s)
    assert sev(f) == expected
    if f:
        assert f[0].first_step > 50 and f[0].evidence[0].window[0] == 50


def test_overfitting_needs_train_loss_falling():
    # both rise after step 50: divergence, not overfitting
    s = stream("sft", EVAL_STEPS, **{"eval__loss": [2.0, 1.8, 1.6, 1.5, 1.45, 1.5, 1.6, 1.7, 1.8, 1.9],
                                     "loss__sft": [2, 1.8, 1.6, 1.5, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9]})
    assert overfitting(s) == []


def test_forgetting_two_proportion_threshold():
    def run(after: float, n: int) -> list:
        rows = [EvalRow("pretrain", "prose_probe", None, "accuracy", 0.24, n), EvalRow("sft", "prose_probe", None, "accuracy", after, n)]
        return forgetting(RunStreams([], rows, ["base", "pretrain", "sft"]))

    # the demo's prose probe, 19% → 5% on 63 facts: se = √(.19·.81/63 + .05·.95/63) = √(.002443 + .000754) = .0565;
    # drop .14 = 2.5 se > 2, ≥ 5 points, 74% of 19% → warning
    rows = [EvalRow("pretrain", "prose_probe", "L1", "exact_match", 0.19, 63), EvalRow("sft", "prose_probe", "L1", "exact_match", 0.05, 63)]
    f = forgetting(RunStreams([], rows, ["base", "pretrain", "sft"]))
    assert sev(f) == Severity.WARNING and "19.0% → 5.0% (2.5 s.e.)" in f[0].summary
    # 24% → 16% on n = 100: se = √(.001824 + .001344) = .0563; drop .08 = 1.4 se < 2 → silent
    assert run(0.16, 100) == []
    # 24% → 20% on n = 10,000: se = .0059, drop .04 = 6.8 se but < 5 points → silent
    assert run(0.20, 10_000) == []
    # 90% → 84% on n = 10,000: 6 points, 15 se, but only 6.7% of 90% (< 20%) → silent
    rows = [EvalRow("pretrain", "arithmetic", "L2", "exact_match", 0.90, 10_000), EvalRow("sft", "arithmetic", "L2", "exact_match", 0.84, 10_000)]
    assert forgetting(RunStreams([], rows, ["base", "pretrain", "sft"])) == []


# ---- DPO -------------------------------------------------------------------------------------------
def dpo(chosen_end: float, rejected_end: float, n: int = 10) -> StageStream:
    # chosen starts at −20 nats, rejected at −25, both move linearly to their end values
    c = [-20 + (chosen_end + 20) * i / (n - 1) for i in range(n)]
    r = [-25 + (rejected_end + 25) * i / (n - 1) for i in range(n)]
    return stream("dpo", **{"logps__chosen": c, "logps__rejected": r})


def test_likelihood_displacement_thresholds():
    # end level = median of the last 3 points (linear: the second-to-last). Start level −20 (median of −20, −20+δ, …
    # it is the second point: −20 + (end+20)/9).
    assert sev(likelihood_displacement(dpo(-40, -60))) == Severity.CRITICAL   # chosen −20 → −40: ≈ 89% of 20 fell
    assert sev(likelihood_displacement(dpo(-24, -40))) == Severity.WARNING    # ≈ 16% of ~20.4 nats
    assert likelihood_displacement(dpo(-21, -40)) == []                       # ≈ 4% < 10%
    assert likelihood_displacement(dpo(-40, -20)) == []                       # rejected rose: not displacement
    assert likelihood_displacement(dpo(-15, -60)) == []                       # chosen rose: the healthy case


def test_reward_scale_collapse():
    acc = [0.6, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    loss = [0.69, 0.4, 0.1, 0.05, 0.03, 0.02, 0.01, 0.01, 0.01, 0.01]
    steps = list(range(10, 101, 10))
    cfg = {"steps": 100, "beta": 0.1, "loss": "dpo"}
    f = reward_scale_collapse(stream("dpo", steps, cfg, **{"rewards__accuracy": acc, "loss__dpo": loss, "rewards__margin": [1] * 10}))
    # trailing 3-point median of accuracy: step 30 → median(.6, .9, 1) = .9; step 40 → 1.0; 40 > 30% of 100 → silent
    assert f == []
    acc_early = [0.9, 1.0, 1.0] + [1.0] * 7  # step 20 → median(.9, 1) = .95; step 30 → 1.0 ≥ .98, and 30 ≤ 30
    f = reward_scale_collapse(stream("dpo", steps, cfg, **{"rewards__accuracy": acc_early, "loss__dpo": loss, "rewards__margin": [1] * 10}))
    assert sev(f) == Severity.WARNING and f[0].first_step == 30
    # same accuracy, but the loss stays at 0.2 (margins not saturated): silent
    assert reward_scale_collapse(stream("dpo", steps, cfg, **{"rewards__accuracy": acc_early, "loss__dpo": [0.2] * 10})) == []


# ---- PPO / GRPO ------------------------------------------------------------------------------------
def test_reward_overoptimization():
    rm = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    # gold peaks at .60 (3-point median) then falls to .40: .20 below peak and .15 below the start .55 → critical
    gold = [0.55, 0.58, 0.60, 0.62, 0.60, 0.55, 0.50, 0.45, 0.40, 0.40]
    assert sev(reward_overoptimization(stream("ppo", **{"rm__score": rm, "gold__reward": gold, "kl": rm}))) == Severity.CRITICAL
    # gold falls from its peak .60 to .53 (≥ .05 below the peak) but stays near its start .55 → warning
    gold_w = [0.55, 0.58, 0.60, 0.62, 0.60, 0.58, 0.56, 0.54, 0.53, 0.53]
    assert sev(reward_overoptimization(stream("ppo", **{"rm__score": rm, "gold__reward": gold_w}))) == Severity.WARNING
    # gold follows the RM up: a real gain
    assert reward_overoptimization(stream("ppo", **{"rm__score": rm, "gold__reward": [0.5 + x / 4 for x in rm]})) == []


@pytest.mark.parametrize("end, trunc_end, expected", [
    (60.0, 0.0, Severity.CRITICAL),  # 20 → 60 tokens: 3×
    (34.0, 0.0, Severity.WARNING),   # 20 → ~33: ≥ 1.5×, < 2×
    (26.0, 0.0, None),               # 1.3×
    (26.0, 0.8, Severity.CRITICAL),  # short growth, but 80% of samples cut at the budget (from 0%)
])
def test_length_explosion(end, trunc_end, expected):
    n = 12
    length = [20 + (end - 20) * i / (n - 1) for i in range(n)]
    trunc = [trunc_end * i / (n - 1) for i in range(n)]
    f = length_explosion(stream("grpo", **{"response__length_mean": length, "response__clipped_ratio": trunc}))
    assert sev(f) == expected


def test_entropy_collapse_and_the_law():
    # H falls 1.0 → 0.05 linearly over 12 points; reward follows R = −0.5·e^H + 1.2 exactly
    n = 12
    h = [1.0 - 0.95 * i / (n - 1) for i in range(n)]
    r = [-0.5 * math.exp(x) + 1.2 for x in h]
    s = stream("grpo", entropy=h, reward__total=r)
    f = entropy_collapse(s)
    # end level ≈ 0.136 (median of the last three ≈ .136) ≤ 30% of 1.0 but > 10% → warning; the fit recovers a, b
    assert sev(f) == Severity.WARNING
    assert "ceiling at entropy 0 near 0.700" in f[0].summary  # b − a = 1.2 − 0.5
    a, b, r2, _ = entropy_fit(Series("entropy", s.series("entropy").steps, h), s.series("reward/total"))
    assert (a, b, r2) == pytest.approx((0.5, 1.2, 1.0))
    # to 0.02 nats: critical
    h2 = [1.0 - 0.98 * i / (n - 1) for i in range(n)]
    h2[-3:] = [0.03, 0.02, 0.02]
    assert sev(entropy_collapse(stream("grpo", entropy=h2))) == Severity.CRITICAL
    # to 0.5 of its start: silent
    assert entropy_collapse(stream("grpo", entropy=[1.0 - 0.5 * i / (n - 1) for i in range(n)])) == []


def test_entropy_collapse_on_solved_problems_is_a_warning():
    # the same fall to 0.02 nats: critical while the pass rate ends at 0.94, a warning once it ends at 0.95
    n = 12
    h = [1.0 - 0.98 * i / (n - 1) for i in range(n)]
    h[-3:] = [0.03, 0.02, 0.02]
    for end, want in ((0.94, Severity.CRITICAL), (0.95, Severity.WARNING)):
        passed = [0.3 + (end - 0.3) * i / (n - 1) for i in range(n)]
        passed[-3:] = [end] * 3
        f = entropy_collapse(stream("grpo", entropy=h, reward__pass_rate=passed))
        assert sev(f) == want, (end, f[0].summary)
    assert "convergence" in f[0].summary


def test_clip_fraction_climb():
    lo = [0.01] * 10
    assert sev(clip_fraction_climb(stream("grpo", **{"clip__low": lo, "clip__high": [0.0, 0.0, 0.02, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5]}))) == Severity.CRITICAL
    assert sev(clip_fraction_climb(stream("grpo", **{"clip__low": lo, "clip__high": [0.0, 0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.25, 0.25]}))) == Severity.WARNING
    assert clip_fraction_climb(stream("grpo", **{"clip__low": lo, "clip__high": [0.0, 0.0, 0.02, 0.05, 0.1, 0.1, 0.1, 0.15, 0.15, 0.15]})) == []


def test_verifier_gaming():
    fmt = [0.2, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.8, 0.8]
    f = verifier_gaming(stream("grpo", **{"reward__format": fmt, "reward__math": [0.10] * 10}))
    assert sev(f) == Severity.CRITICAL  # format +0.6, accuracy +0.0 (≤ start)
    f = verifier_gaming(stream("grpo", **{"reward__format": fmt, "reward__math": [0.10, 0.10, 0.11, 0.11, 0.12, 0.12, 0.13, 0.13, 0.14, 0.14]}))
    assert sev(f) == Severity.WARNING  # accuracy +0.03 < 0.05, above its start
    # accuracy rises with the format: a real gain
    assert verifier_gaming(stream("grpo", **{"reward__format": fmt, "reward__math": [x / 2 for x in fmt]})) == []


def test_difficulty_mismatch():
    z = [0.5, 0.6, 0.7, 0.7, 0.8, 0.8, 0.8, 0.9, 0.9, 0.9]
    f = difficulty_mismatch(stream("grpo", **{"groups__zero_variance_frac": z, "reward__pass_rate": [0.9] * 10}))
    assert sev(f) == Severity.WARNING and "too easy" in f[0].summary  # second half median .9
    assert difficulty_mismatch(stream("grpo", **{"groups__zero_variance_frac": [0.3] * 5 + [0.55] * 5})) == []


# ---- numerics --------------------------------------------------------------------------------------
def test_non_finite():
    f = non_finite(stream("sft", **{"loss__sft": [2.0, 1.9, float("nan"), 1.8], "train__grad_norm": [1.0, 1.0, float("inf"), 1.0]}))
    assert sev(f) == Severity.CRITICAL and f[0].first_step == 3
    assert non_finite(stream("sft", **{"loss__sft": [2.0, 1.9, 1.8], "train__lr": [float("nan")] * 3})) == []  # lr is not watched


def test_grad_spike():
    base = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.1, 0.9, 1.0]
    # one 8× spike: log 8 = 2.08 ≫ 6·σ (σ of log norm ≈ .07) and ≥ 5× → warning at step 11
    f = grad_spike(stream("sft", **{"train__grad_norm": base + [8.0] + base}))
    assert sev(f) == Severity.WARNING and f[0].first_step == 11
    # three spikes → critical
    assert sev(grad_spike(stream("sft", **{"train__grad_norm": base + [8.0] + base + [9.0] + base + [10.0]}))) == Severity.CRITICAL
    # 3× is no spike (< 5×)
    assert grad_spike(stream("sft", **{"train__grad_norm": base + [3.0] + base})) == []


def test_grad_spike_in_a_noisy_window_is_capped_at_20x():
    # a turbulent window: norms alternate 1 and 4 → logs 0, 1.386; median of the 10 = 0.693, every
    # |deviation| = 0.693 → robust σ = 1.4826 × 0.693 = 1.028, so 6σ = 6.17 in log (a 476× bar)
    noisy = [1.0, 4.0] * 5
    # 40× the median 2.0 (log 3.0): under 6σ = 6.17, but σ is capped at ln 20 / 6 = 0.499 → bar ln 20 = 3.0 < ln 40 = 3.69
    f = grad_spike(stream("sft", **{"train__grad_norm": noisy + [80.0]}))
    assert sev(f) == Severity.WARNING and f[0].first_step == 11
    # 15× the median (log 2.71 < ln 20 = 3.0): no spike in that noise
    assert grad_spike(stream("sft", **{"train__grad_norm": noisy + [30.0]})) == []


def test_ratio_mismatch_only_at_mu_one():
    r = [1.001, 1.002, 2.0, 1.001, 1.003, 1.001]
    assert sev(ratio_mismatch(stream("grpo", config={"mu": 1}, **{"clip__ratio_max": r}))) == Severity.WARNING
    assert sev(ratio_mismatch(stream("grpo", config={"mu": 1}, **{"clip__ratio_max": [2.0] * 6}))) == Severity.CRITICAL
    assert ratio_mismatch(stream("grpo", config={"mu": 4}, **{"clip__ratio_max": [2.0] * 6})) == []
    assert ratio_mismatch(stream("grpo", config={"mu": 1}, **{"clip__ratio_max": [1.01] * 6})) == []
