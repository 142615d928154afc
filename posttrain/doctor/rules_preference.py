"""Offline preference optimization (the DPO family): likelihood displacement and reward-scale collapse.

1. `likelihood_displacement` — the log-probabilities of the chosen AND the rejected responses both
   fall while the margin between them grows: the probability mass leaves both for responses in
   neither set (Razin et al. 2025, "Unintentional Unalignment: Likelihood Displacement in Direct
   Preference Optimization", ICLR; Pal et al. 2024, "Smaug: Fixing Failure Modes of Preference
   Optimisation with DPO-Positive"; Rafailov et al. 2024, "From r to Q*").
2. `reward_scale_collapse` — accuracy of the implicit reward reaches 1.0 early, the margin saturates
   and the loss goes to 0: the data is separated and β·log-ratio keeps growing without a target
   (Azar et al. 2024, "A General Theoretical Paradigm to Understand Learning from Human Preferences",
   §4: DPO overfits a deterministic preference; IPO's fix).
"""

from __future__ import annotations

import math

from posttrain.doctor.findings import Finding, Severity, evidence
from posttrain.doctor.stats import MIN_POINTS, end_level, first_persistent, noise, rolling_median, start_level

# Chosen log-prob (a sum over the response's tokens) falling by this share of its own start level,
# with the rejected one falling too: warning at 10%, critical at 35% (the chosen sequence is then
# e^(0.35·|logp₀|) times less likely than before training: on the demo's ~20-nat responses, ~1,000×).
DISPLACE_WARN, DISPLACE_CRIT = 0.10, 0.35
COLLAPSE_ACC, COLLAPSE_LOSS, COLLAPSE_EARLY = 0.98, 0.05, 0.3  # accuracy ≥ 0.98 within the first 30% of steps; loss ≤ 0.05


def likelihood_displacement(s) -> list[Finding]:
    """`logps/chosen` and `logps/rejected` both fall from the stage's start by more than 3× noise and
    ≥ 10% (warning) / ≥ 35% (critical) of the chosen start level."""
    if s.kind != "dpo":
        return []
    c, r = s.series("logps/chosen").clean(), s.series("logps/rejected").clean()
    if len(c) < MIN_POINTS or len(r) < MIN_POINTS:
        return []
    c0, r0 = start_level(c.values), start_level(r.values)
    dc, dr = end_level(c.values) - c0, end_level(r.values) - r0
    floor = max(3 * noise(c.values), DISPLACE_WARN * abs(c0))
    if not (dc < -floor and dr < -max(3 * noise(r.values), 0.0)) or c0 == 0:
        return []
    rel = -dc / abs(c0)
    sev = Severity.CRITICAL if rel >= DISPLACE_CRIT else Severity.WARNING
    smooth = rolling_median(c.values)
    first = first_persistent(c.steps, [v < c0 - floor for v in smooth]) or c.steps[-1]
    margin = s.series("rewards/margin").clean()
    extra = (f"; the margin meanwhile went {start_level(margin.values):.2f} → {end_level(margin.values):.2f}"
             if len(margin) >= MIN_POINTS else "")
    window = (first, c.steps[-1])
    ev = [evidence("logps/chosen", c.steps, c.values, window, c0), evidence("logps/rejected", r.steps, r.values, window, r0)]
    return [Finding(
        "likelihood_displacement", s.name, sev, first,
        f"chosen log-prob fell {c0:.1f} → {c0 + dc:.1f} nats ({rel:.0%} of its start) and rejected {r0:.1f} → {r0 + dr:.1f}{extra}",
        "DPO widens the gap by pushing both responses down: the probability goes to outputs in neither set, "
        "so the policy drifts off the data's distribution (and can lose the chosen behaviour it was shown)",
        "lower the learning rate (or train fewer steps/epochs), raise β, or add an SFT/NLL term on the chosen "
        "response (DPO-Positive, RPO)",
        ev, "Razin et al. 2025 (likelihood displacement); Pal et al. 2024 (DPO-Positive)")]


def reward_scale_collapse(s) -> list[Finding]:
    """DPO (sigmoid) only: `rewards/accuracy` ≥ 0.98 (3-point median) within the first 30% of the stage,
    and the loss's end level ≤ 0.05 (ln 2 = 0.693 at the start)."""
    if s.kind != "dpo" or s.config.get("loss", "dpo") != "dpo":
        return []
    acc, loss = s.series("rewards/accuracy").clean(), s.series("loss/dpo").clean()
    if len(acc) < MIN_POINTS or len(loss) < MIN_POINTS:
        return []
    steps_total = int(s.config.get("steps") or s.last_step or 1)
    smooth = rolling_median(acc.values)
    hit = next((st for st, v in zip(acc.steps, smooth) if v >= COLLAPSE_ACC), None)
    end_loss = end_level(loss.values)
    if hit is None or hit > COLLAPSE_EARLY * steps_total or not end_loss <= COLLAPSE_LOSS:
        return []
    margin = s.series("rewards/margin").clean()
    beta = float(s.config.get("beta", 0.1))
    m1 = end_level(margin.values) if len(margin) else math.nan
    ev = [evidence("rewards/accuracy", acc.steps, acc.values, (hit, acc.steps[-1]), COLLAPSE_ACC),
          evidence("loss/dpo", loss.steps, loss.values, (hit, loss.steps[-1]), math.log(2))]
    if len(margin):
        ev.append(evidence("rewards/margin", margin.steps, margin.values, (hit, margin.steps[-1])))
    return [Finding(
        "reward_scale_collapse", s.name, Severity.WARNING, hit,
        f"implicit-reward accuracy reached {COLLAPSE_ACC:.0%} by step {hit} of {steps_total}; loss {end_loss:.3f} "
        f"(ln 2 = 0.693 at the start), margin {m1:.1f} (= {m1 / beta:.0f} nats of log-ratio at β {beta:g})",
        "the pairs are separated: the loss has no gradient left to shape, and further steps only inflate the "
        "log-ratio (the implicit reward has no scale), which is where likelihood displacement starts",
        "stop earlier or use fewer steps, harder pairs, label smoothing (cDPO) or IPO's bounded target",
        ev, "Azar et al. 2024 (IPO: DPO overfits separable preferences)")]
