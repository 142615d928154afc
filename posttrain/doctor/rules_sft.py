"""Supervised stages (pretrain, SFT): overfitting in-stage, forgetting between stages.

1. `overfitting` — the held-out loss turns up while the train loss keeps falling: the textbook sign
   of memorizing the training set (early stopping, Prechelt 1998, "Early stopping — but when?",
   whose GL criterion is the rise of validation loss over its minimum, relative to that minimum).
2. `forgetting` — a held-out eval (exact match, the prose probe of facts) drops between checkpoints
   by more than its sampling error: the alignment tax / catastrophic forgetting of fine-tuning
   (Ouyang et al. 2022, InstructGPT §4 "alignment tax"; Luo et al. 2023, "An Empirical Study of
   Catastrophic Forgetting in LLMs During Continual Fine-tuning").
"""

from __future__ import annotations

import math

from posttrain.doctor.findings import Finding, Severity, evidence
from posttrain.doctor.stats import MIN_POINTS, end_level, first_persistent, noise, theil_sen
from posttrain.doctor.streams import RunStreams, StageStream

# Prechelt's generalization loss GL(t) = 100·(E_va(t)/E_opt − 1): he stops at GL > 5 (%) in his
# experiments; we warn at a 3% rise and call 10% critical, both also above 3× the curve's own noise.
OVERFIT_WARN, OVERFIT_CRIT = 0.03, 0.10
# a drop > 2 standard errors (one-sided p ≈ 0.02), ≥ 5 points and ≥ 20% of the earlier value: the evals
# are a few dozen to a few hundred fixed problems per level (L1 has 63), so 3 s.e. would miss the demo's
# prose-probe drop (19% → 5% on 63 facts: 2.5 s.e.), while the 5-point and 20% floors keep a large eval
# from flagging a small move. Warning only.
FORGET_Z, FORGET_MIN_DROP, FORGET_MIN_REL = 2.0, 0.05, 0.2

HIGHER_IS_BETTER = ("exact_match", "pass@", "accuracy", "win_rate", "format", "probe", "correct")


def overfitting(s: StageStream) -> list[Finding]:
    """Held-out `eval/loss` rises ≥ 3% over its minimum (and > 3× its noise) while the train loss falls.

    Needs `eval_every` in the recipe (an SFT stage evaluates its held-out loss only at the end
    otherwise) and at least MIN_POINTS eval points, two of them after the minimum."""
    if s.kind not in ("sft", "pretrain"):
        return []
    ev = s.series("eval/loss").clean()
    train = s.series("loss/sft" if s.kind == "sft" else "loss/lm").clean()
    if len(ev) < MIN_POINTS or len(train) < MIN_POINTS:
        return []
    i_min = min(range(len(ev)), key=lambda i: ev.values[i])
    best, best_step = ev.values[i_min], ev.steps[i_min]
    if len(ev) - i_min - 1 < 2 or best <= 0:
        return []
    rise = end_level(ev.values[i_min + 1 :], 2) - best
    floor = max(3 * noise(ev.values), OVERFIT_WARN * best)
    after = train.since(best_step)
    train_falls = len(after) >= 2 and theil_sen(after.steps, after.values) < 0
    if rise <= floor or not train_falls:
        return []
    rel = rise / best
    first = first_persistent(ev.steps, [s_ > best_step and v - best > floor for s_, v in zip(ev.steps, ev.values)]) or ev.steps[-1]
    sev = Severity.CRITICAL if rel >= OVERFIT_CRIT else Severity.WARNING
    window = (best_step, ev.steps[-1])
    return [Finding(
        "overfitting", s.name, sev, first,
        f"held-out loss rose {rel:.0%} above its minimum {best:.3f} (step {best_step}) to {best + rise:.3f} "
        f"while the train loss fell from {after.values[0]:.3f} to {after.values[-1]:.3f}",
        "the model is fitting the training examples themselves, not the task: past the held-out minimum "
        "every step trades generalization for memorization (style, phrasing, the exact examples)",
        f"stop at the held-out minimum (the checkpoint nearest step {best_step}), train fewer epochs, add data, "
        "or lower the learning rate",
        [evidence("eval/loss", ev.steps, ev.values, window, best), evidence(train.metric, train.steps, train.values, window)],
        "Prechelt 1998, 'Early stopping — but when?' (generalization loss GL)")]


def _higher_is_better(name: str, metric: str) -> bool:
    return any(k in name or k in metric for k in HIGHER_IS_BETTER)


def forgetting(run: RunStreams) -> list[Finding]:
    """A between-stage eval drops by > 2 standard errors (two proportions), ≥ 5 points and ≥ 20%.

    Compares each stage's evals with the previous evaluated checkpoint's (same eval, level, metric).
    Warning only: a stage may trade a skill on purpose; the doctor says which one was traded."""
    by_stage: dict[str, dict[tuple, tuple[float, int]]] = {}
    for r in run.evals:
        by_stage.setdefault(r.stage, {})[r.key] = (r.value, r.n)
    order = [st for st in run.stage_order if st in by_stage] + [st for st in by_stage if st not in run.stage_order]
    out = []
    for prev, cur in zip(order, order[1:]):
        drops = []
        for key, (after, n2) in by_stage[cur].items():
            if key not in by_stage[prev] or not _higher_is_better(key[0], key[2]):
                continue
            before, n1 = by_stage[prev][key]
            if not (0 <= before <= 1 and 0 <= after <= 1) or n1 <= 0 or n2 <= 0:
                continue
            se = math.sqrt(before * (1 - before) / n1 + after * (1 - after) / n2) or 1 / max(n1, n2)
            drop = before - after
            if drop >= FORGET_MIN_DROP and drop >= FORGET_MIN_REL * before and drop > FORGET_Z * se:
                drops.append((key, before, after, drop / se))
        if not drops:
            continue
        drops.sort(key=lambda d: -d[3])
        what = "; ".join(f"{k[0]}{' ' + k[1] if k[1] else ''} {k[2]} {b:.1%} → {a:.1%} ({z:.1f} s.e.)" for k, b, a, z in drops)
        out.append(Finding(
            "forgetting", cur, Severity.WARNING, 0,
            f"held-out evals fell after {cur} (vs {prev}): {what}",
            f"{cur} traded these skills away: what it trained on does not exercise them, and fine-tuning "
            "overwrote them (the alignment tax)",
            "mix some of the earlier stage's data into this stage (replay), lower the learning rate or train fewer "
            "steps, or add a KL/reference term; if the drop is intended (e.g. prose recall after chat SFT), accept it",
            [evidence(f"{k[0]}{'/' + k[1] if k[1] else ''}/{k[2]}", [0, 1], [b, a], (0, 1), b, [prev, cur]) for k, b, a, _ in drops[:4]],
            "Ouyang et al. 2022 (alignment tax); Luo et al. 2023 (catastrophic forgetting in fine-tuning)"))
    return out
