"""Numerical trouble, any stage: non-finite values, gradient-norm spikes, importance ratios far from 1
where they must be 1.

1. `non_finite` — a NaN or ±Inf in a loss, the gradient norm, a reward, the entropy or the KL: the
   step that produced it corrupted (or would corrupt) the weights. Critical at the first one.
2. `grad_spike` — the gradient norm jumps above its own recent level by > 6 robust σ (of log norm)
   and ≥ 5×: loss spikes precede divergence in large-model training (Chowdhery et al. 2022, PaLM
   §5.1; Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
   instabilities"). One is a warning; three or more in a stage are critical. The σ is capped at
   ln 20 / 6, so a jump of ≥ 20× the recent median is a spike however noisy the window: an unstable
   run's own turbulence inflates its trailing σ (measured: 0.7–0.8 in log after the first spikes of
   recipes/failures/sft-lr-spike.yaml, a 6σ bar of 70–120×), and an uncapped rule goes blind exactly
   when the run is unstable.
3. `ratio_mismatch` — with μ = 1 (GRPO: one optimizer step per rollout) the update runs at the very
   weights that sampled, so the importance ratio π/π_old must be 1 up to round-off; a max ratio
   ≥ 1.5 means the sampler's and the learner's log-probs disagree (different kernels, dtype, a stale
   or wrong policy in the engine: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
   Off-Policy RL Training", on rollout/trainer mismatch).
"""

from __future__ import annotations

import math

from posttrain.doctor.findings import Finding, Severity, evidence
from posttrain.doctor.stats import MIN_POINTS, mad_sigma, median
from posttrain.doctor.streams import StageStream

WATCHED = ("loss/", "train/grad_norm", "reward/total", "entropy", "kl", "rm/score", "eval/loss", "logps/")
SPIKE_SIGMA, SPIKE_FACTOR, SPIKE_WINDOW, SPIKE_CRIT_COUNT = 6.0, 5.0, 10, 3
SPIKE_SIGMA_MIN = 0.05                      # a perfectly flat norm is not infinitely sensitive
SPIKE_SIGMA_MAX = math.log(20.0) / SPIKE_SIGMA  # ≥ 20× the recent median is a spike, however noisy the window
RATIO_WARN = 1.5


def _watched(name: str) -> bool:
    return any(name == w or (w.endswith("/") and name.startswith(w)) for w in WATCHED)


def non_finite(s: StageStream) -> list[Finding]:
    """The first record with a NaN/Inf in a watched metric; critical."""
    for r in s.records:
        # finiteness first: a record carries ~100 keys (the per-phase roofline ones too), nearly all finite, and
        # matching each name against WATCHED made this rule ~16 ms of every live check at 100 records (now ~1)
        bad = sorted(k for k, v in r.items() if isinstance(v, float) and not math.isfinite(v) and _watched(k))
        if not bad:
            continue
        step = int(r["step"])
        series = [s.series(k) for k in bad[:3]]
        return [Finding(
            "non_finite", s.name, Severity.CRITICAL, step,
            f"{', '.join(bad)} = {', '.join(str(r[k]) for k in bad)} at step {step}",
            "a non-finite loss or gradient means this step's update was garbage (an overflow, a log of 0, a division "
            "by an empty mask); every step after it trains a corrupted model",
            "resume from the last checkpoint before this step with a lower learning rate or tighter gradient "
            "clipping; in bf16 check the loss in fp32; look for empty masks or zero-length responses",
            [evidence(x.metric, x.steps, x.values, (step, step)) for x in series],
            "standard practice (PyTorch anomaly detection; Megatron/DeepSpeed skip-on-overflow)")]
    return []


def grad_spike(s: StageStream) -> list[Finding]:
    """`train/grad_norm` above the trailing median of the previous 10 points by > 6 robust σ of log-norm
    (σ clipped to [0.05, ln 20 / 6]) and ≥ 5×; warning for one, critical for ≥ 3."""
    g = s.series("train/grad_norm").clean()
    pts = [(st, v) for st, v in zip(g.steps, g.values) if v > 0]
    if len(pts) < MIN_POINTS + 1:
        return []
    logs = [math.log(v) for _, v in pts]
    spikes = []
    for i in range(MIN_POINTS, len(pts)):
        past = logs[max(0, i - SPIKE_WINDOW) : i]
        m, sd = median(past), min(max(mad_sigma(past), SPIKE_SIGMA_MIN), SPIKE_SIGMA_MAX)
        if logs[i] - m > SPIKE_SIGMA * sd and logs[i] - m >= math.log(SPIKE_FACTOR):
            spikes.append((pts[i][0], pts[i][1], math.exp(m)))
    if not spikes:
        return []
    sev = Severity.CRITICAL if len(spikes) >= SPIKE_CRIT_COUNT else Severity.WARNING
    first = spikes[0][0]
    worst = max(spikes, key=lambda x: x[1] / x[2])
    clip = s.config.get("optim", {}).get("grad_clip", 1.0) if isinstance(s.config.get("optim"), dict) else 1.0
    return [Finding(
        "grad_spike", s.name, sev, first,
        f"{len(spikes)} gradient-norm spike(s), first at step {first}; worst {worst[1]:.3g} at step {worst[0]} "
        f"against a recent median of {worst[2]:.3g} (clipped to {clip:g} before the update)",
        "a batch (or a state of the optimizer) produced a gradient far outside the run's own range; clipping "
        "bounds the step, but repeated spikes precede divergence",
        "lower the learning rate or lengthen warmup; check the spiking steps' batches (outlier lengths, bad "
        "labels); in bf16, keep the loss and softmax in fp32",
        [evidence("train/grad_norm", g.steps, g.values, (first, spikes[-1][0]))],
        "Chowdhery et al. 2022 (PaLM loss spikes); Wortsman et al. 2023 (small-scale instabilities)")]


def ratio_mismatch(s: StageStream) -> list[Finding]:
    """GRPO at μ = 1: `clip/ratio_max` ≥ 1.5 at any logged step (warning), at half of them (critical)."""
    if s.kind != "grpo" or int(s.config.get("mu", 1)) != 1:
        return []
    r = s.series("clip/ratio_max").clean()
    if len(r) < MIN_POINTS:
        return []
    high = [(st, v) for st, v in zip(r.steps, r.values) if v >= RATIO_WARN]
    if not high:
        return []
    sev = Severity.CRITICAL if len(high) >= len(r) / 2 else Severity.WARNING
    return [Finding(
        "ratio_mismatch", s.name, sev, high[0][0],
        f"importance ratio π/π_old reached {max(v for _, v in high):.3g} at μ = 1 ({len(high)} of {len(r)} logged "
        f"steps ≥ {RATIO_WARN}); it must be 1 up to round-off there",
        "the rollout engine's log-probs disagree with the learner's for the same weights: the update is "
        "off-policy without knowing it (a stale engine, different kernels or dtype, a sampling transform "
        "like temperature not applied on both sides)",
        "check that the engine's weights are refreshed after each update and that temperature/top-p are applied "
        "to both log-probs; compare the two log-probs on one batch; fall back to the hf backend to bisect",
        [evidence("clip/ratio_max", r.steps, r.values, (high[0][0], high[-1][0]), 1.0)],
        "Yao et al. 2025 (rollout/trainer mismatch); Schulman et al. 2017 (PPO ratio)")]
