"""The DPO family: offline preference optimization of the policy against its own start (the reference).

Losses and their papers are in `posttrain.losses.preference` (DPO: Rafailov et al. 2023, eq. 7; IPO:
Azar et al. 2023, eq. 17; KTO: Ethayarajh et al. 2024, eq. 8; ORPO: Hong et al. 2024, eqs. 6–7; SimPO:
Meng et al. 2024, eq. 6); `PREFERENCE_METHODS` says, per method, which log-prob reduction it takes,
whether it needs a reference and whether its data is paired. The stage chooses once (`OBJECTIVES`).

Every training item is two sequences, `a` and `b`: paired methods use (chosen, rejected); KTO uses
(the labelled completion, a mismatched completion of another prompt for its reference point z0).
The reference model's log-probs of both are computed once, before training, in the `reference` phase
and cached (N, 2) — the reference never changes, so recomputing them every step (`reference:
recompute`, kept to prove the two agree) only costs a forward per step. Methods without a reference
(ORPO, SimPO) load no reference model and skip the phase.

Metrics per step: `loss/<method>`, implicit rewards `rewards/chosen`, `rewards/rejected`,
`rewards/margin`, `rewards/accuracy`, and the policy's own `logps/chosen`, `logps/rejected` (as the
method reduces them: summed, or length-normalized for ORPO/SimPO) — both falling while the margin
grows is likelihood displacement. At the end: a head-to-head against the start policy on held-out
problems under the gold judge (`eval/h2h/win_rate` over non-tied comparisons).

Departures:
1. KTO's z0 is estimated per micro-batch (the paper: per batch) from the fixed mismatched partners of
   `_preference_data.kto_partners`, under no_grad (z0 carries no gradient in the paper either).
2. With `grad_accum` > 1 every loss is normalized by the whole optimizer batch (sums, not means of
   micro-batch means), so accumulation changes memory, never the gradient.

Data-parallel (docs/distributed.md; replicate only): every rank draws the same global batch, cuts it
into the same micro-batches (`grad_accum` rounded up to a multiple of the world size) and runs those
dealt to it (r, r + W, …); the loss stays normalized by the global batch's items, the gradients and the
loss are summed over the ranks, the per-micro-batch statistics averaged over all of them. Every rank
computes the whole reference cache (a forward over all items, duplicated: simple, and cheap beside
training); the final head-to-head runs on rank 0 alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from posttrain.data import (
    EncodedCompletion,
    EpochSampler,
    PreferencePair,
    UnpairedExample,
    encode_completion,
    encode_preference,
)
from posttrain.losses import (
    PREFERENCE_METHODS,
    PreferenceLoss,
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    simpo_loss,
)
from posttrain.distributed import DistributedError, deal
from posttrain.runtime.config import DPOStage
from posttrain.runtime.context import RunContext, StageResult
from posttrain.stages._gold_eval import compare_to_reference, gold_task
from posttrain.stages._packing import pair_logps, sequence_logps
from posttrain.stages._preference_data import kto_partners, load_records
from posttrain.stages._training import (
    batch_split_problem,
    micro_batch_count,
    optimizer_step,
    reduce_gradients,
    reference_policy,
    save,
    start_or_resume,
)
from posttrain.tasks import Task
from posttrain.telemetry import costs


class Item(NamedTuple):
    """One training item: two sequences (see the module docstring) and, for KTO, the label of `a`."""

    a: EncodedCompletion
    b: EncodedCompletion
    desirable: bool | None


class Sides(NamedTuple):
    """Sequence log-probs of a micro-batch. Shape: (B,) each; ref_* None without a reference."""

    policy_a: Tensor
    policy_b: Tensor
    ref_a: Tensor | None
    ref_b: Tensor | None
    desirable: Tensor  # (B,) bool (all True for paired methods)


Objective = Callable[[Sides, DPOStage, float], tuple[Tensor, object]]

OBJECTIVES: dict[PreferenceLoss, Objective] = {
    PreferenceLoss.DPO: lambda s, c, n: dpo_loss(s.policy_a, s.policy_b, s.ref_a, s.ref_b, beta=c.beta,
                                                 label_smoothing=c.label_smoothing, normalizer=n),
    PreferenceLoss.IPO: lambda s, c, n: ipo_loss(s.policy_a, s.policy_b, s.ref_a, s.ref_b, beta=c.beta, normalizer=n),
    PreferenceLoss.KTO: lambda s, c, n: kto_loss(s.policy_a, s.ref_a, s.desirable,
                                                 reference_point=kto_reference_point(s.policy_b, s.ref_b), beta=c.beta,
                                                 desirable_weight=c.kto_desirable_weight,
                                                 undesirable_weight=c.kto_undesirable_weight, normalizer=n),
    PreferenceLoss.ORPO: lambda s, c, n: orpo_loss(s.policy_a, s.policy_b, beta=c.beta, normalizer=n),
    PreferenceLoss.SIMPO: lambda s, c, n: simpo_loss(s.policy_a, s.policy_b, beta=c.beta, gamma=c.simpo_gamma, normalizer=n),
}

METRIC_NAMES = {"chosen_rewards": "rewards/chosen", "rejected_rewards": "rewards/rejected", "margin": "rewards/margin",
                "accuracy": "rewards/accuracy", "chosen_logps": "logps/chosen", "rejected_logps": "logps/rejected"}


def load_items(ctx: RunContext, cfg: DPOStage) -> tuple[list[Item], dict[str, int]]:
    """The stage's items and the readers' skip counts (reason → rows)."""
    paired = PREFERENCE_METHODS[PreferenceLoss(cfg.loss)].paired
    loaded = load_records(ctx.tasks, cfg.data, "preference" if paired else "unpaired", seed=ctx.recipe.seed)
    for line in loaded.summaries:
        ctx.console.print(f"{cfg.folder}: {line}")
    tok = ctx.tokenizer
    if paired:
        pairs: list[PreferencePair] = loaded.records  # type: ignore[assignment]
        encoded = [encode_preference(p, tok, cfg.max_len, truncation=cfg.truncation) for p in pairs]
        return [Item(e.chosen, e.rejected, None) for e in encoded], loaded.skipped
    examples: list[UnpairedExample] = loaded.records  # type: ignore[assignment]
    partner = kto_partners(examples, ctx.recipe.seed)
    items = []
    for i, ex in enumerate(examples):
        a = encode_completion(ex.prompt, ex.completion, tok, cfg.max_len, truncation=cfg.truncation, origin=ex.origin)
        b = encode_completion(ex.prompt, examples[partner[i]].completion, tok, cfg.max_len, truncation="left", origin=ex.origin)
        items.append(Item(a, b, ex.label))
    return items, loaded.skipped


@torch.no_grad()
def reference_logps(ref_model, items: list[Item], pad_id: int, batch: int, *, paired: bool) -> Tensor:
    """Reference log-probs (summed) of both sequences of every item. Shape: (N, 2)."""
    out = []
    for i in range(0, len(items), batch):
        chunk = items[i : i + batch]
        if paired:
            a, b = pair_logps(ref_model, [(it.a, it.b) for it in chunk], pad_id, length_normalized=False)
        else:  # KTO: the mismatched sequence may have been truncated differently; no shared prompt assumed
            a, b = sequence_logps(ref_model, [it.a for it in chunk] + [it.b for it in chunk], pad_id,
                                  length_normalized=False).split(len(chunk))
        out.append(torch.stack([a, b], dim=1))  # (b, 2)
    return torch.cat(out)


def micro_sides(model, items: list[Item], ref: Tensor | None, pad_id: int, *, paired: bool, length_normalized: bool) -> Sides:
    """Policy log-probs of a micro-batch: one shared-prompt forward per pair; KTO's `b` under no_grad."""
    if paired:
        policy_a, policy_b = pair_logps(model, [(it.a, it.b) for it in items], pad_id, length_normalized=length_normalized)
    else:
        policy_a = sequence_logps(model, [it.a for it in items], pad_id, length_normalized=length_normalized)
        with torch.no_grad():
            policy_b = sequence_logps(model, [it.b for it in items], pad_id, length_normalized=length_normalized)
    desirable = torch.tensor([bool(it.desirable) if not paired else True for it in items], device=policy_a.device)
    return Sides(policy_a, policy_b, None if ref is None else ref[:, 0], None if ref is None else ref[:, 1], desirable)


def data_parallel_problem(cfg: DPOStage, world_size: int) -> str | None:
    """Why this stage cannot run on `world_size` ranks, or None."""
    return batch_split_problem(cfg, world_size, "pairs")


def run_dpo(cfg: DPOStage, ctx: RunContext) -> StageResult:
    # ---- setup ---------------------------------------------------------------------------------
    if problem := data_parallel_problem(cfg, ctx.ranks.world_size):
        raise DistributedError(problem)
    tok, method = ctx.tokenizer, PREFERENCE_METHODS[PreferenceLoss(cfg.loss)]
    objective = OBJECTIVES[PreferenceLoss(cfg.loss)]
    items, skipped = load_items(ctx, cfg)
    n_skipped = float(sum(skipped.values()))
    gold = gold_task(ctx, cfg.folder, cfg.data, "gold win rate vs the start policy", heldout=True) if cfg.eval_per_level else None
    t = start_or_resume(ctx, cfg, data_parallel=True)
    sampler = EpochSampler(len(items), cfg.batch_size, seed=ctx.recipe.seed)
    if t.data_state is not None:
        sampler.load_state_dict(t.data_state)
    ranks, n_micro = ctx.ranks, micro_batch_count(cfg.grad_accum, ctx.ranks.world_size)
    micro = cfg.batch_size // n_micro
    mean_len = sum(len(it.a.input_ids) + len(it.b.input_ids) for it in items) / (2 * len(items))
    ctx.console.print(
        f"{cfg.folder}: {cfg.loss} on {len(items):,} {'pairs' if method.paired else 'examples'} "
        f"({int(n_skipped)} skipped: {skipped or 'none'}); {cfg.batch_size} per step (2 sequences each, ≈{mean_len:.0f} tokens) "
        f"in {n_micro} micro-batches"
        + (f" ({ranks.world_size} ranks × {n_micro // ranks.world_size} of {micro})" if ranks.world_size > 1 else "")
        + f"; {sampler.batches_per_epoch} steps per epoch; reference: "
        f"{cfg.reference if method.uses_reference else 'none'}")
    ref, ref_cache = None, None
    if method.uses_reference:
        ref = reference_policy(ctx, t.model)
        if cfg.reference == "cached":
            with ctx.phase("reference", stage=cfg.folder, step=t.step + 1,
                           cost=costs.forward(ref.config, batch=2 * len(items), seq_len=round(mean_len))), \
                    ctx.autocast(), ref() as ref_model:
                ref_cache = reference_logps(ref_model, items, tok.pad_token_id, cfg.reference_batch, paired=method.paired)  # (N, 2)
            ref = None  # the cache replaces it

    # ---- loop ----------------------------------------------------------------------------------
    metrics: dict[str, float] = {}
    with ctx.progress() as bar:
        task = bar.add_task(cfg.folder, total=cfg.steps, completed=t.step, info="")
        while t.step < cfg.steps:
            step, t0 = t.step + 1, time.perf_counter()
            index = sampler.next_batch()
            batch = [items[i] for i in index]
            seq_len = max(max(len(it.a.input_ids), len(it.b.input_ids)) for it in batch)
            if ref is not None:  # reference: recompute
                with ctx.phase("reference", stage=cfg.folder, step=step,
                               cost=costs.forward(ref.config, batch=2 * len(batch), seq_len=seq_len)), ctx.autocast(), \
                        ref() as ref_model:
                    ref_lp = reference_logps(ref_model, batch, tok.pad_token_id, micro, paired=method.paired)
            else:
                ref_lp = None if ref_cache is None else ref_cache[torch.as_tensor(index)]
            with ctx.phase("update", stage=cfg.folder, step=step,
                           cost=costs.train_step(t.model.config, batch=2 * len(batch), seq_len=seq_len)):
                total, parts = 0.0, []
                for i in deal(range(0, len(batch), micro), ranks):  # this rank's micro-batches (all in one process)
                    with ctx.autocast():
                        sides = micro_sides(t.model, batch[i : i + micro], None if ref_lp is None else ref_lp[i : i + micro],
                                            tok.pad_token_id, paired=method.paired, length_normalized=method.length_normalized)
                        loss, stats = objective(sides, cfg, float(len(batch)))
                    loss.backward()
                    total += loss.item()
                    parts.append(stats.as_floats())
                reduce_gradients(t, ranks)  # the step's gradient: every rank's micro-batches (a sync point)
                total = ranks.sum({"loss": total})["loss"]
                grad_norm = optimizer_step(t, cfg.optim, {f"loss/{cfg.loss}": total})
            metrics = {f"loss/{cfg.loss}": total, "train/grad_norm": grad_norm, "train/lr": t.scheduler.get_last_lr()[0],
                       "train/pairs_per_s": len(batch) / (time.perf_counter() - t0), **t.guard.metrics()}
            means = ranks.mean({k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}, dict.fromkeys(parts[0], len(parts)))
            metrics.update({METRIC_NAMES.get(k, f"train/{k}"): v for k, v in means.items()})  # means over every micro-batch
            if step == cfg.steps and gold is not None and ranks.is_main:
                metrics.update(gold_head_to_head(ctx, cfg, gold, t.model, step))
            if step == 1 or step % cfg.log_every == 0 or step == cfg.steps:
                ctx.log(cfg.folder, step, {**metrics, "data/skipped": n_skipped})
            bar.update(task, completed=step, info=f"loss {total:.3f}  margin {metrics['rewards/margin']:.2f}")
            if step % cfg.save_every == 0 and step < cfg.steps:
                save(ctx, cfg, t, data_state=sampler.state_dict())

    # ---- save ----------------------------------------------------------------------------------
    final = save(ctx, cfg, t, data_state=sampler.state_dict(), final=True)
    summary = {k: v for k, v in metrics.items() if k.startswith(("loss/", "eval/", "rewards/", "logps/"))}
    return StageResult(final, {**summary, "data/skipped": n_skipped})


def gold_head_to_head(ctx: RunContext, cfg: DPOStage, gold: Task, model, step: int) -> dict[str, float]:
    """The policy against the start policy on held-out problems, judged by the task's gold reward."""
    with ctx.phase("eval", stage=cfg.folder, step=step):
        reference = ctx.load_model(ctx.start)
        h2h = compare_to_reference(model, reference, ctx.tokenizer, gold.heldout_problems(cfg.eval_per_level), gold,
                                   temperature=cfg.eval_temperature, samples=cfg.eval_samples,
                                   max_new_tokens=cfg.max_new_tokens, seed=ctx.recipe.seed + 7)
    return h2h.metrics("eval/h2h")
