"""Reward model: a scalar head on the start policy's backbone, trained with the Bradley–Terry loss.

Reference: InstructGPT (Ouyang et al. 2022), §3.5 and eq. 1 — r_θ(x, y) is the SFT model with its
unembedding replaced by a scalar projection; the loss is −log σ(r_θ(x, y_w) − r_θ(x, y_l)) averaged
over the C(K,2) pairs of each ranking of K responses, so every ranking counts once (a pair is a
ranking of K = 2). Normalization (appendix C.2): scores are shifted so that the start policy's samples
average 0 — here also scaled to unit std (`posttrain.models.heads`, departure 3).

Departures:
1. The reward is read at the reply's last token (its EOS), not after the chat template's trailing
   newline: that is where a PPO rollout ends, so training and use agree.
2. Evals: held-out pair accuracy on fresh world pairs, per kind (style: concise vs rambling;
   correctness: right vs wrong answer), and agreement with the gold judge on the start policy's own
   samples (the share of same-prompt sample pairs with different gold rewards that the RM orders
   like the judge) — the proxy-vs-gold gap PPO will meet.
3. The stage hands the pipeline its *start* checkpoint (the policy), not the reward model: the next
   stage (PPO) continues the policy and finds the reward model by name. `reward_norm.json` records
   the policy too, so a PPO stage handed the reward model (the pipeline's resume path) can recover it.

Data-parallel (docs/distributed.md; replicate only): every rank draws the same global batch of
rankings, cuts it into the same micro-batches (`grad_accum` rounded up to a multiple of the world size)
and runs those dealt to it; the loss stays normalized by the global batch's rankings, the gradients and
the loss are summed over the ranks, the per-micro-batch statistics averaged over all of them. Evals, the
normalization and the final checkpoint are rank 0's (the ranks hold the same weights).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from posttrain.data import EncodedCompletion, EpochSampler, collate_sft, encode_prompt
from posttrain.losses import bradley_terry_loss, rankings_to_pairs
from posttrain.models import save_model
from posttrain.models.heads import (
    RewardNormalization,
    last_token_scores,
    load_scalar_model,
)
from posttrain.runtime.checkpoint import (
    FINAL,
    STATE_FILE,
    SUMMARY_FILE,
    publish,
    rng_state,
)
from posttrain.runtime.config import DataSource, RewardModelStage
from posttrain.runtime.context import RunContext, StageResult
from posttrain.rollout import SamplingParams, make_engine
from posttrain.data.records import Problem
from posttrain.runtime.config import task_names
from posttrain.stages._gold_eval import gold_task
from posttrain.tasks import Capability, Task
from posttrain.stages._preference_data import encode_ranking_like, load_records
from posttrain.distributed import DistributedError, deal
from posttrain.stages._training import (
    Trainer,
    batch_split_problem,
    micro_batch_count,
    optimizer_step,
    reduce_gradients,
    save,
    start_or_resume,
)
from posttrain.telemetry import costs

Item = list[EncodedCompletion]  # one ranking's responses, best first (a pair: [chosen, rejected])


def ranking_loss(model, items: list[Item], pad_id: int, normalizer: float):
    """Bradley–Terry over every pair of every ranking in `items`. Returns (loss, RewardStats)."""
    flat = [r for item in items for r in item]
    b = collate_sft(flat, pad_id)  # (R, T) right-padded; each row ends at its reply's EOS
    scores = last_token_scores(model, b.input_ids, b.attention_mask)  # (R,)
    pairs = rankings_to_pairs([list(range(len(item))) for item in items])
    return bradley_terry_loss(scores[pairs.chosen], scores[pairs.rejected], weights=pairs.weights, normalizer=normalizer)


@torch.no_grad()
def pair_accuracy(model, items: list[Item], kinds: list[str], pad_id: int, batch: int = 64) -> dict[str, float]:
    """Held-out accuracy (r_chosen > r_rejected) overall and per kind; mean margin."""
    model.eval()
    right: list[bool] = []
    margins: list[float] = []
    for i in range(0, len(items), batch):
        b = collate_sft([r for it in items[i : i + batch] for r in it], pad_id)
        s = last_token_scores(model, b.input_ids, b.attention_mask).view(-1, 2)  # (P, 2) chosen, rejected
        right += (s[:, 0] > s[:, 1]).tolist()
        margins += (s[:, 0] - s[:, 1]).tolist()
    model.train()
    out = {"eval/accuracy": sum(right) / len(right), "eval/margin": sum(margins) / len(margins)}
    for kind in sorted(set(kinds)):
        hits = [r for r, k in zip(right, kinds) if k == kind]
        out[f"eval/accuracy_{kind}"] = sum(hits) / len(hits)
    return out


@torch.no_grad()
def normalize_and_agree(ctx: RunContext, cfg: RewardModelStage, model, step: int, problems: list[Problem],
                        gold: Task | None) -> tuple[RewardNormalization, dict[str, float]]:
    """Score the start policy's samples on `problems`: their mean/std normalize the reward; pairs of
    same-prompt samples the gold judge tells apart measure the RM's agreement with it (no judge: no
    agreement metric)."""
    tok, k = ctx.tokenizer, cfg.samples_per_prompt
    policy = ctx.load_model(ctx.start)
    prompts = [encode_prompt(p.prompt, tok) for p in problems]
    params = SamplingParams(n=k, temperature=1.0, max_new_tokens=cfg.max_new_tokens, seed=ctx.recipe.seed)
    with ctx.phase("generate", stage=cfg.folder, step=step) as ph:
        engine = make_engine("native", policy, tok)
        r = engine.generate(prompts, params)
        ph.cost = engine.decode_cost(batch=len(r), prompt_len=r.prompt_ids.shape[1],
                                     new_tokens=max(1, r.completion_ids.shape[1]), samples=params.n)
    model.eval()
    with ctx.phase("score", stage=cfg.folder, step=step,
                   cost=costs.forward(model.config, batch=len(r), seq_len=r.sequence_ids.shape[1], logits="scalar")):
        scores = last_token_scores(model, r.sequence_ids, r.sequence_mask, r.position_ids).cpu()  # (R,)
    model.train()
    rows = [problems[i] for i in r.prompt_index.tolist()]
    gold_r = gold.gold_rewards(rows, r.texts, r.finish_reason) if gold is not None else [None] * len(rows)
    agree = total = 0
    for p in range(len(problems)):
        rows = range(p * k, p * k + k)
        for a in rows:
            for b in rows:
                ga, gb = gold_r[a], gold_r[b]
                if a < b and ga is not None and gb is not None and ga != gb:
                    total += 1
                    agree += (scores[a] - scores[b]).item() * (ga - gb) > 0
    mean, std = scores.mean().item(), scores.std().item()
    policy_ref = str(ctx.start.relative_to(ctx.run_dir)) if ctx.start.is_relative_to(ctx.run_dir) else str(ctx.start)
    norm = RewardNormalization(mean=mean, std=max(std, 1e-6), n=len(r), policy=policy_ref)
    known = [g for g in gold_r if g is not None]
    metrics = {"eval/score_mean_raw": mean, "eval/score_std_raw": std}
    if gold is not None:
        metrics.update({"eval/gold_agreement": agree / total if total else float("nan"), "eval/gold_pairs": total,
                        "eval/start_gold_reward": sum(known) / len(known) if known else float("nan")})
    return norm, metrics


def heldout_pairs(ctx: RunContext, cfg: RewardModelStage) -> list:
    """`heldout` fresh pairs of the first data task that has pairs (a different seed offset from training)."""
    if not cfg.heldout:
        return []
    task = ctx.tasks.first_with(task_names(cfg.data + cfg.rankings), Capability.PREFERENCE)
    if task is None:
        ctx.console.print(f"[dim]{cfg.folder}: no held-out pair accuracy (no data source is a task that supplies pairs)")
        return []
    return load_records(ctx.tasks, [DataSource(task=task.name, n=cfg.heldout)], "preference", seed=ctx.recipe.seed,
                        seed_offset=1).records


def norm_prompts(ctx: RunContext, cfg: RewardModelStage, train: list) -> tuple[list[Problem], Task | None]:
    """The prompts whose start-policy samples normalize the reward: fresh problems of the first data task
    that has them, with its gold judge; else the training records' own prompts, and no gold agreement."""
    n = max(1, cfg.norm_samples // cfg.samples_per_prompt)
    sources = cfg.data + cfg.rankings
    task = ctx.tasks.first_with(task_names(sources), Capability.PROBLEMS)
    if task is not None:
        problems = task.records("problem", n, seed_offset=17)
        return problems, gold_task(ctx, cfg.folder, sources, "gold agreement")  # type: ignore[return-value]
    ctx.console.print(f"[dim]{cfg.folder}: gold agreement omitted (no data source is a task with problems and a gold "
                      "judge); the reward is normalized on the training prompts")
    return [Problem(prompt=r.prompt, origin=r.origin) for r in train[:n]], None


def save_final(ctx: RunContext, cfg: RewardModelStage, t: Trainer, norm: RewardNormalization) -> Path:
    """The final checkpoint with `reward_norm.json` inside it, published in one atomic rename."""

    def write(tmp: Path) -> None:
        save_model(t.model, ctx.tokenizer, tmp)
        torch.save({"stage": cfg.folder, "step": t.step, "data": None, "rng": rng_state()}, tmp / STATE_FILE)
        (tmp / SUMMARY_FILE).write_text(json.dumps({"step": t.step, "stage": cfg.folder, "final": True}, indent=2))
        norm.save(tmp)

    return publish(ctx.stage_dir(cfg.folder) / FINAL, write)


def data_parallel_problem(cfg: RewardModelStage, world_size: int) -> str | None:
    """Why this stage cannot run on `world_size` ranks, or None."""
    return batch_split_problem(cfg, world_size, "rankings")


def run_reward_model(cfg: RewardModelStage, ctx: RunContext) -> StageResult:
    # ---- setup ---------------------------------------------------------------------------------
    if problem := data_parallel_problem(cfg, ctx.ranks.world_size):
        raise DistributedError(problem)
    tok, seed = ctx.tokenizer, ctx.recipe.seed
    loaded = [load_records(ctx.tasks, cfg.data, "preference", seed=seed)] if cfg.data else []
    loaded += [load_records(ctx.tasks, cfg.rankings, "ranking", seed=seed)] if cfg.rankings else []
    if not loaded:
        raise ValueError(f"{cfg.folder}: no training data; give `data` (pairs) and/or `rankings`")
    skipped = {reason: n for ld in loaded for reason, n in ld.skipped.items()}
    for ld in loaded:
        for line in ld.summaries:
            ctx.console.print(f"{cfg.folder}: {line}")
    train: list[Item] = [encode_ranking_like(r, tok, cfg.max_len, cfg.truncation) for ld in loaded for r in ld.records]
    held = heldout_pairs(ctx, cfg)
    norm_problems, gold = norm_prompts(ctx, cfg, [r for ld in loaded for r in ld.records])
    val = [encode_ranking_like(r, tok, cfg.max_len, "left") for r in held]
    kinds = [str(r.meta.get("kind", "all")) for r in held]
    # a new zero head on the start policy, or the scalar model of the checkpoint being resumed
    t = start_or_resume(ctx, cfg, load=lambda path, resuming: load_scalar_model(path, device=ctx.device,
                                                                                zero_head=not resuming),
                        heads=("score",), data_parallel=True)  # with LoRA the scalar head trains in full beside the adapter
    sampler = EpochSampler(len(train), cfg.batch_size, seed=seed)
    if t.data_state is not None:
        sampler.load_state_dict(t.data_state)
    ranks, n_micro = ctx.ranks, micro_batch_count(cfg.grad_accum, ctx.ranks.world_size)
    micro = cfg.batch_size // n_micro
    pairs_per_step = cfg.batch_size * sum(len(i) * (len(i) - 1) // 2 for i in train) / len(train)
    ctx.console.print(
        f"{cfg.folder}: {len(train):,} rankings/pairs ({sum(skipped.values())} skipped: {skipped or 'none'}); "
        f"{cfg.batch_size} per step (≈{pairs_per_step:.0f} pairs) in {n_micro} micro-batches"
        + (f" ({ranks.world_size} ranks × {n_micro // ranks.world_size} of {micro})" if ranks.world_size > 1 else "")
        + "; "
        f"{sampler.batches_per_epoch} steps per epoch; {len(val)} held-out pairs")

    # ---- loop ----------------------------------------------------------------------------------
    metrics: dict[str, float] = {}
    with ctx.progress() as bar:
        task = bar.add_task(cfg.folder, total=cfg.steps, completed=t.step, info="")
        while t.step < cfg.steps:
            step, t0 = t.step + 1, time.perf_counter()
            batch = [train[i] for i in sampler.next_batch()]
            rows, seq_len = sum(len(i) for i in batch), max(len(r.input_ids) for i in batch for r in i)
            with ctx.phase("update", stage=cfg.folder, step=step,
                           cost=costs.train_step(t.model.config, batch=rows, seq_len=seq_len, logits="scalar")):
                total, parts = 0.0, []
                for i in deal(range(0, len(batch), micro), ranks):  # this rank's micro-batches (all in one process)
                    with ctx.autocast():
                        loss, stats = ranking_loss(t.model, batch[i : i + micro], tok.pad_token_id, normalizer=len(batch))
                    loss.backward()
                    total += loss.item()
                    parts.append(stats.as_floats())
                reduce_gradients(t, ranks)  # the step's gradient: every rank's micro-batches (a sync point)
                total = ranks.sum({"loss": total})["loss"]
                grad_norm = optimizer_step(t, cfg.optim, {"loss/reward_model": total})
            metrics = {"loss/reward_model": total, "train/grad_norm": grad_norm, "train/lr": t.scheduler.get_last_lr()[0],
                       "train/sequences_per_s": rows / (time.perf_counter() - t0), **t.guard.metrics()}
            means = ranks.mean({k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}, dict.fromkeys(parts[0], len(parts)))
            metrics.update({f"train/{k}": v for k, v in means.items()})  # means over every micro-batch
            if val and ranks.is_main and (cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps):
                with ctx.phase("eval", stage=cfg.folder, step=step):
                    metrics.update(pair_accuracy(t.model, val, kinds, tok.pad_token_id))
            if step == cfg.steps and ranks.is_main:
                norm, agreement = normalize_and_agree(ctx, cfg, t.model, step, norm_problems, gold)
                metrics.update(agreement)
            if step == 1 or step % cfg.log_every == 0 or step == cfg.steps:
                ctx.log(cfg.folder, step, {**metrics, "data/skipped": float(sum(skipped.values()))})
            bar.update(task, completed=step, info=f"loss {total:.3f}  acc {metrics['train/accuracy']:.2f}")
            if step % cfg.save_every == 0 and step < cfg.steps:
                save(ctx, cfg, t, data_state=sampler.state_dict())

    # ---- save ----------------------------------------------------------------------------------
    final = ctx.stage_dir(cfg.folder) / FINAL
    if ranks.is_main:
        final = save_final(ctx, cfg, t, norm)
        ctx.console.print(f"{cfg.folder}: reward model → {final}  (normalization: mean {norm.mean:.3f}, std {norm.std:.3f})")
    ranks.barrier()  # a sync point: the reward model is published for every rank (PPO loads it next)
    summary = {k: v for k, v in metrics.items() if k.startswith(("loss/", "eval/"))}
    return StageResult(ctx.start, {**summary, "data/skipped": float(sum(skipped.values()))})
