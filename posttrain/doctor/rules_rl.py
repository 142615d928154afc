"""Online RL stages (PPO against a reward model, GRPO/DAPO against verifiers).

1. `reward_overoptimization` — the reward model's score rises while the gold reward (logged beside it)
   falls, KL to the start policy growing: Goodhart on a learned proxy (Gao, Schulman & Hilton 2023,
   "Scaling Laws for Reward Model Overoptimization": gold follows d·(α − β·d) in d = √KL while the
   proxy keeps rising).
2. `length_explosion` — mean response length (and the share cut at the token budget) climbs far over
   the stage's start: length is the cheapest feature a reward model rewards (Singhal et al. 2023,
   "A Long Way to Go: Investigating Length Correlations in RLHF"); DAPO §3.4 on truncated samples.
3. `entropy_collapse` — policy entropy falls toward 0; with Cui et al. 2025's law R ≈ −a·e^H + b
   ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models", eq. 1) fitted on
   the logged (entropy, reward) pairs, the reward the run will saturate at when entropy is spent is
   b − a, predictable from early steps.
4. `clip_fraction_climb` — the share of tokens whose importance ratio is clipped climbs: each update
   moves the policy further than the trust region (Schulman et al. 2017, PPO; Engstrom et al. 2020,
   "Implementation Matters in Deep RL").
5. `verifier_gaming` — a format reward climbs while accuracy (the math/gold verifier, logged even at
   weight 0) stays flat: the policy learned the verifier's surface, not the task (Skalse et al. 2022,
   "Defining and Characterizing Reward Hacking"; DeepSeek-R1 2025 §2.2.2 on rule-based rewards).
6. `difficulty_mismatch` — most groups are all-correct or all-wrong: zero reward variance, zero GRPO
   advantage, generation spent for nothing (Yu et al. 2025, DAPO §3.2 dynamic sampling).
7. `importance_weight_drift` — asynchronous (or mismatched) rollouts: the truncated importance weights
   min(π_prox/π_behav, C) drift from 1 (their mean) or hit the cap ever more often: the behaviour policy
   is too far from the learner for the correction to stay cheap — the truncation biases the gradient and
   the kept weights raise its variance (Yao et al. 2025, "Your efficient RL framework secretly brings you
   off-policy RL training"; Fu et al. 2025, AReaL §5 on the staleness bound).
"""

from __future__ import annotations

import math

from posttrain.doctor.findings import Finding, Severity, evidence
from posttrain.doctor.stats import (MIN_POINTS, end_level, first_persistent, linear_fit, noise, rolling_median,
                                    start_level, theil_sen)
from posttrain.doctor.streams import Series, StageStream

RL_KINDS = ("ppo", "grpo")

# reward over-optimization: the gold falls by ≥ 0.05 (rewards in [0, 1]) and 3× its noise from its peak
# (warning) or below the stage's start (critical), while the RM score rises by 3× its noise
GOLD_DROP = 0.05
LENGTH_WARN, LENGTH_CRIT = 1.5, 2.0      # end / start of mean length
TRUNC_CRIT, TRUNC_RISE = 0.5, 0.3        # share cut at max_new_tokens: ≥ 50% and up ≥ 30 points from the start
ENTROPY_WARN, ENTROPY_CRIT = 0.3, 0.1    # end / start of mean token entropy
ENTROPY_MIN_START = 0.05                 # nats: a policy that starts (nearly) deterministic has nothing to collapse
ENTROPY_SOLVED = 0.95                    # end pass rate at which low entropy is convergence: at most a warning
CLIP_WARN, CLIP_CRIT = 0.2, 0.4          # clipped-token share, and ≥ 3× its start
FORMAT_RISE, ACC_FLAT = 0.15, 0.05       # format reward up ≥ 15 points while accuracy moves < 5 points
ZERO_VAR_WARN = 0.6                      # ≥ 60% of groups carry no signal (median over the stage's second half)
# truncated IS weights: |mean − 1| at the end ≥ 0.2 (warning) / ≥ 0.5 (critical); or the share of tokens at the
# cap ends ≥ 5% (warning) / ≥ 20% (critical), up from its start by more than 3× its noise
IS_MEAN_WARN, IS_MEAN_CRIT = 0.2, 0.5
IS_TRUNC_WARN, IS_TRUNC_CRIT = 0.05, 0.2


def _rise(x: Series) -> tuple[float, float, float]:
    """(start level, end level, noise) of a clean curve."""
    return start_level(x.values), end_level(x.values), noise(x.values)


def _window_from(x: Series, flags: list[bool]) -> tuple[int, int]:
    first = first_persistent(x.steps, flags)
    return (first if first is not None else x.steps[-1], x.steps[-1])


def reward_overoptimization(s: StageStream) -> list[Finding]:
    """PPO: `rm/score` up by > 3× noise while `gold/reward` falls ≥ 0.05 and > 3× noise from its peak
    (warning) or from its start (critical); `kl` growing is reported as corroboration."""
    if s.kind != "ppo":
        return []
    rm, gold, kl = s.series("rm/score").clean(), s.series("gold/reward").clean(), s.series("kl").clean()
    if len(rm) < MIN_POINTS or len(gold) < MIN_POINTS:
        return []
    rm0, rm1, rm_noise = _rise(rm)
    g0, g1, g_noise = _rise(gold)
    smooth = rolling_median(gold.values)
    i_peak = max(range(len(smooth)), key=lambda i: smooth[i])
    peak = smooth[i_peak]
    floor = max(GOLD_DROP, 3 * g_noise)
    if not (rm1 - rm0 > 3 * rm_noise and rm1 > rm0 and peak - g1 > floor):
        return []
    sev = Severity.CRITICAL if g0 - g1 > floor else Severity.WARNING
    window = _window_from(gold, [st > gold.steps[i_peak] and v < peak - floor for st, v in zip(gold.steps, smooth)])
    kl_note = ""
    ev = [evidence("rm/score", rm.steps, rm.values, window, rm0), evidence("gold/reward", gold.steps, gold.values, window, g0)]
    if len(kl) >= MIN_POINTS:
        kl_note = f"; KL to the start policy {start_level(kl.values):.2f} → {end_level(kl.values):.2f} nats"
        ev.append(evidence("kl", kl.steps, kl.values, window))
    return [Finding(
        "reward_overoptimization", s.name, sev, window[0],
        f"reward-model score rose {rm0:+.2f} → {rm1:+.2f} while the gold reward fell from {peak:.2f} (its peak, "
        f"step {gold.steps[i_peak]}) to {g1:.2f} (start {g0:.2f}){kl_note}",
        "the policy is exploiting the reward model's errors: the proxy says better, the held-out judge says worse "
        "(Goodhart); past the gold peak more KL buys only proxy reward",
        "stop at the gold peak's checkpoint, raise the KL coefficient (or set a KL target), retrain the reward "
        "model on the policy's own samples, or use a reward-model ensemble",
        ev, "Gao, Schulman & Hilton 2023 (reward model overoptimization)")]


def length_explosion(s: StageStream) -> list[Finding]:
    """Mean response length ≥ 1.5× the stage's start (warning), ≥ 2× or the truncated share ≥ 50% and
    up ≥ 30 points (critical); the rise must also exceed 3× the curve's noise and still be climbing."""
    if s.kind not in RL_KINDS:
        return []
    length = s.series("response/length" if s.kind == "ppo" else "response/length_mean").clean()
    trunc = s.series("response/truncated" if s.kind == "ppo" else "response/clipped_ratio").clean()
    if len(length) < MIN_POINTS:
        return []
    l0, l1, l_noise = _rise(length)
    ratio = l1 / l0 if l0 > 0 else math.inf
    t0, t1 = (start_level(trunc.values), end_level(trunc.values)) if len(trunc) >= MIN_POINTS else (0.0, 0.0)
    trunc_bad = t1 >= TRUNC_CRIT and t1 - t0 >= TRUNC_RISE
    half = length.since(length.steps[len(length) // 2])
    climbing = theil_sen(half.steps, half.values) > 0 or ratio >= LENGTH_CRIT
    if not ((ratio >= LENGTH_WARN and l1 - l0 > 3 * l_noise and climbing) or trunc_bad):
        return []
    sev = Severity.CRITICAL if ratio >= LENGTH_CRIT or trunc_bad else Severity.WARNING
    window = _window_from(length, [v >= LENGTH_WARN * l0 for v in rolling_median(length.values)]) \
        if ratio >= LENGTH_WARN else _window_from(trunc, [v >= TRUNC_CRIT for v in rolling_median(trunc.values)])
    ev = [evidence(length.metric, length.steps, length.values, window, l0)]
    if len(trunc):
        ev.append(evidence(trunc.metric, trunc.steps, trunc.values, window, t0))
    budget = s.config.get("max_new_tokens")
    return [Finding(
        "length_explosion", s.name, sev, window[0],
        f"mean response length {l0:.1f} → {l1:.1f} tokens ({ratio:.1f}× the stage's start); "
        f"cut at the {budget or '?'}-token budget: {t0:.0%} → {t1:.0%}",
        "the reward is paying for length (a reward model that learned 'longer is better', or an unpenalized "
        "budget), not for better answers; truncated samples carry a reward for text that never finished",
        "add a length penalty or DAPO's overlong penalty, mask truncated samples (mask_truncated), normalize the "
        "reward model for length, or raise the KL coefficient",
        ev, "Singhal et al. 2023 (length correlations in RLHF); Yu et al. 2025 (DAPO overlong shaping)")]


def entropy_fit(entropy: Series, reward: Series) -> tuple[float, float, float, int] | None:
    """Fit R = −a·e^H + b (Cui et al. 2025, eq. 1) on the steps where both were logged: least squares
    of R on x = e^H, so R = c0 + c1·x with a = −c1, b = c0. Returns (a, b, R², n) or None."""
    rs = dict(zip(reward.steps, reward.values))
    pairs = [(math.exp(h), rs[st]) for st, h in zip(entropy.steps, entropy.values) if st in rs]
    if len(pairs) < MIN_POINTS:
        return None
    c0, c1, r2 = linear_fit([p[0] for p in pairs], [p[1] for p in pairs])
    return -c1, c0, r2, len(pairs)


def _reward_series(s: StageStream) -> Series:
    return s.series("rm/score" if s.kind == "ppo" else "reward/total").clean()


def entropy_collapse(s: StageStream) -> list[Finding]:
    """Entropy's end level ≤ 30% (warning) / ≤ 10% (critical) of its start (≥ 0.05 nats), falling by
    > 3× noise. The summary carries the ceiling b − a of R = −a·e^H + b fitted on the first half. A stage
    whose pass rate ends ≥ 0.95 has converged on its problems rather than lost its exploration: a warning."""
    if s.kind not in RL_KINDS:
        return []
    h = s.series("entropy").clean()
    if len(h) < MIN_POINTS:
        return []
    h0, h1, h_noise = _rise(h)
    if h0 < ENTROPY_MIN_START or h1 > ENTROPY_WARN * h0 or h0 - h1 <= 3 * h_noise:
        return []
    sev = Severity.CRITICAL if h1 <= ENTROPY_CRIT * h0 else Severity.WARNING
    window = _window_from(h, [v <= ENTROPY_WARN * h0 for v in rolling_median(h.values)])
    reward = _reward_series(s)
    law = ""
    passed = s.series("reward/pass_rate").clean()
    solved = len(passed) >= MIN_POINTS and end_level(passed.values) >= ENTROPY_SOLVED
    if solved:  # nothing left to explore on these problems: convergence, unless held-out evals stall
        sev = Severity.WARNING
        law = f"; the stage solves its problems (pass rate {end_level(passed.values):.2f}): convergence more than collapse"
    early = Series(h.metric, h.steps[: max(MIN_POINTS, len(h) // 2)], h.values[: max(MIN_POINTS, len(h) // 2)])
    fit = entropy_fit(early, reward)
    if fit is not None and fit[0] > 0 and fit[2] >= 0.5:
        a, b, r2, n = fit
        law += (f"; R ≈ −{a:.3g}·e^H + {b:.3g} fitted on the first {n} points (R² {r2:.2f}) puts the reward "
               f"ceiling at entropy 0 near {b - a:.3f} (last logged reward {end_level(reward.values):.3f})")
    ev = [evidence("entropy", h.steps, h.values, window, h0)]
    if len(reward):
        ev.append(evidence(reward.metric, reward.steps, reward.values, window))
    return [Finding(
        "entropy_collapse", s.name, sev, window[0],
        f"token entropy fell {h0:.3f} → {h1:.3f} nats ({h1 / h0:.0%} of the stage's start){law}",
        "the policy has become (nearly) deterministic: samples in a group agree, advantages vanish, and the "
        "reward stops improving at the ceiling the entropy left it (the exploration is spent)",
        "lower the learning rate or raise the temperature, use clip-higher (DAPO) or a covariance clip "
        "(Clip-Cov/KL-Cov), or add an entropy bonus",
        ev, "Cui et al. 2025, 'The Entropy Mechanism of RL for Reasoning LMs' (R = −a·e^H + b)")]


def clip_fraction_climb(s: StageStream) -> list[Finding]:
    """Clipped-token share (low + high) ends ≥ 0.2 (warning) / ≥ 0.4 (critical) and ≥ 3× its start
    + 3× noise. With μ = 1 (GRPO) the ratio is 1 at its only update: the rule has nothing to see."""
    if s.kind not in RL_KINDS:
        return []
    lo, hi = ("policy/clip_frac_low", "policy/clip_frac_high") if s.kind == "ppo" else ("clip/low", "clip/high")
    a, b = s.series(lo).clean(), s.series(hi).clean()
    if len(a) < MIN_POINTS or len(a) != len(b):
        return []
    c = Series("clip fraction", a.steps, [x + y for x, y in zip(a.values, b.values)])
    c0, c1, c_noise = _rise(c)
    if c1 < CLIP_WARN or c1 < 3 * c0 or c1 - c0 <= 3 * c_noise:
        return []
    sev = Severity.CRITICAL if c1 >= CLIP_CRIT else Severity.WARNING
    window = _window_from(c, [v >= CLIP_WARN for v in rolling_median(c.values)])
    return [Finding(
        "clip_fraction_climb", s.name, sev, window[0],
        f"share of tokens with a clipped importance ratio {c0:.1%} → {c1:.1%}",
        "each update moves the policy far outside the trust region, so most tokens give no gradient and the "
        "ones that do are noisy: the step size is too large for this batch",
        "lower the learning rate, use fewer PPO epochs / smaller μ, or larger batches",
        [evidence(f"{lo}+{hi.rsplit('/', 1)[1]}", c.steps, c.values, window, c0)],
        "Schulman et al. 2017 (PPO clipping); Engstrom et al. 2020")]


FORMAT_METRICS = ("reward/format",)
ACCURACY_METRICS = ("reward/math", "reward/gold", "gold/correct")


def verifier_gaming(s: StageStream) -> list[Finding]:
    """A format reward rises ≥ 15 points (and 3× noise) while the accuracy verifier gains < 5 points
    (and < 3× noise): warning; critical when accuracy ends at or below its start (+ 1× noise)."""
    if s.kind != "grpo":
        return []
    fmt = next((s.series(m).clean() for m in FORMAT_METRICS if s.has(m)), None)
    acc = next((s.series(m).clean() for m in ACCURACY_METRICS if s.has(m)), None)
    if fmt is None or acc is None or len(fmt) < MIN_POINTS or len(acc) < MIN_POINTS:
        return []
    f0, f1, f_noise = _rise(fmt)
    a0, a1, a_noise = _rise(acc)
    rose = f1 - f0 >= max(FORMAT_RISE, 3 * f_noise)
    flat = a1 - a0 < max(ACC_FLAT, 3 * a_noise)  # flat or falling
    if not (rose and flat):
        return []
    sev = Severity.CRITICAL if a1 <= a0 + a_noise else Severity.WARNING
    window = _window_from(fmt, [v >= f0 + FORMAT_RISE for v in rolling_median(fmt.values)])
    return [Finding(
        "verifier_gaming", s.name, sev, window[0],
        f"{fmt.metric} rose {f0:.2f} → {f1:.2f} while {acc.metric} went {a0:.2f} → {a1:.2f}",
        "the policy is learning what the verifier checks (the answer's shape) rather than the task: reward "
        "goes up, correctness does not",
        "weight the correctness verifier (math/gold) over the format one, or gate format reward on a correct "
        "answer; keep a held-out accuracy verifier logged at weight 0",
        [evidence(fmt.metric, fmt.steps, fmt.values, window, f0), evidence(acc.metric, acc.steps, acc.values, window, a0)],
        "Skalse et al. 2022 (reward hacking); DeepSeek-AI 2025, R1 §2.2.2")]


def difficulty_mismatch(s: StageStream) -> list[Finding]:
    """Median `groups/zero_variance_frac` over the stage's second half ≥ 0.6 (warning only: waste, not
    harm); says too easy or too hard from the pass rate."""
    if s.kind != "grpo":
        return []
    z = s.series("groups/zero_variance_frac").clean()
    if len(z) < MIN_POINTS:
        return []
    half = z.since(z.steps[len(z) // 2])
    level = sorted(half.values)[len(half) // 2]
    if level < ZERO_VAR_WARN:
        return []
    pr = s.series("reward/pass_rate").clean()
    p = end_level(pr.values) if len(pr) else math.nan
    side = ("too easy: most groups are all-correct" if p >= 0.5 else "too hard: most groups are all-wrong") \
        if math.isfinite(p) else "all-correct or all-wrong"
    window = (half.steps[0], half.steps[-1])
    dyn = bool(s.config.get("dynamic_sampling"))
    return [Finding(
        "difficulty_mismatch", s.name, Severity.WARNING, window[0],
        f"{level:.0%} of groups had zero reward variance over steps {window[0]}–{window[1]} ({side}; pass rate {p:.2f})",
        "a group whose samples all score the same has zero advantage: its generation teaches nothing"
        + (" and dynamic sampling re-draws it (generation spent twice)" if dyn else ""),
        "move the problem mix toward the model's frontier (levels it solves 10–90% of the time), or filter "
        "problems by the start policy's pass rate; larger groups also help on hard problems",
        [evidence(z.metric, z.steps, z.values, window, ZERO_VAR_WARN)] + ([evidence(pr.metric, pr.steps, pr.values, window)] if len(pr) else []),
        "Yu et al. 2025 (DAPO §3.2, dynamic sampling)")]


def importance_weight_drift(s: StageStream) -> list[Finding]:
    """`offpolicy/is_weight_mean` ends ≥ 0.2 from 1 (warning; ≥ 0.5 critical), or `offpolicy/is_truncated_frac`
    ends ≥ 5% and rose by more than 3× its noise (warning; ≥ 20% critical). Silent without the correction."""
    if s.kind not in RL_KINDS:
        return []
    w, tr = s.series("offpolicy/is_weight_mean").clean(), s.series("offpolicy/is_truncated_frac").clean()
    if len(w) < MIN_POINTS:
        return []
    w0, w1 = start_level(w.values), end_level(w.values)
    t0, t1, t_noise = _rise(tr) if len(tr) >= MIN_POINTS else (0.0, 0.0, 0.0)
    drift = abs(w1 - 1.0)
    trunc_up = t1 >= IS_TRUNC_WARN and t1 - t0 > 3 * t_noise
    if drift < IS_MEAN_WARN and not trunc_up:
        return []
    sev = Severity.CRITICAL if drift >= IS_MEAN_CRIT or (trunc_up and t1 >= IS_TRUNC_CRIT) else Severity.WARNING
    if drift >= IS_MEAN_WARN:
        window = _window_from(w, [abs(v - 1.0) >= IS_MEAN_WARN for v in rolling_median(w.values)])
    else:
        window = _window_from(tr, [v >= IS_TRUNC_WARN for v in rolling_median(tr.values)])
    ev = [evidence(w.metric, w.steps, w.values, window, 1.0)]
    if len(tr):
        ev.append(evidence(tr.metric, tr.steps, tr.values, window, t0))
    k = s.config.get("max_staleness")
    return [Finding(
        "importance_weight_drift", s.name, sev, window[0],
        f"mean truncated importance weight min(π_prox/π_behav, C) {w0:.2f} → {w1:.2f}; tokens at the cap "
        f"{t0:.1%} → {t1:.1%}" + (f" (max_staleness {k})" if k is not None else ""),
        "the policy that sampled the rollouts is far from the learner's: the correction keeps the gradient "
        "unbiased only while the weights stay near 1 — capped tokens bias it, large weights make it noisy",
        "lower max_staleness (k = 1 is usually enough to overlap generate and update), lower the learning rate, "
        "or use more samples per update; keep off_policy: decoupled on",
        ev, "Yao et al. 2025 (truncated IS); Fu et al. 2025 (AReaL, decoupled PPO and the staleness bound)")]
