"""RLVR: GRPO, DAPO and Dr. GRPO against programmatic verifiers, with dynamic sampling.

References:
- GRPO: Shao et al. 2024, "DeepSeekMath", §4.1, eq. 3: G samples per prompt, advantage
  Â_i = (r_i − mean(r)) / std(r) for every token of sample i, the PPO clipped surrogate with the
  ratio π_θ/π_old per token, the k3 KL to the reference (eq. 4) inside the loss, and the loss
  averaged per sequence then over the group (`seq_mean_token_mean`).
- DAPO: Yu et al. 2025, eqs. 8–12: clip-higher (ε_low 0.2, ε_high 0.28), dynamic sampling (eq. 11:
  keep only groups with 0 < #correct < G, sample until the batch is full), token-level mean
  (eq. 12), overlong filtering (§3.4: truncated samples masked out), no KL term.
- Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1: no std division in the
  advantage, and the loss summed over tokens and divided by a constant (the generation budget),
  removing GRPO's length and difficulty biases.

The three losses are rows of one table (`GRPO_VARIANTS`): advantage function, aggregation, clip range.

Departures (numbered):
1. `steps` counts optimizer steps; a rollout batch is reused for μ of them, each over the whole
   batch (no shuffled mini-batches), with the importance ratio against the sampling-time
   `policy_logprobs` (the raw model at T = 1, as the rollout engine records them). With μ = 1 the
   ratio is 1 up to kernel round-off and the clip never binds.
2. The training log-probs are the raw model's (T = 1) even when rollouts are sampled at T < 1:
   the update sharpens the model itself, which is what greedy evaluation reads. Sampling at T < 1
   is then mildly off-policy (samples come from the tempered policy); see docs/rlvr.md for why it
   is what made the tiny model learn.
3. Dynamic sampling is bounded (`max_rounds`): if the batch is still short, the step trains on the
   groups it has (counted as `dynamic/short_groups`), and a step with no usable group takes no
   optimizer step (the scheduler still advances, so `steps` keeps its meaning). Every sequence
   generated and not trained on is counted (`dynamic/waste_frac`).
4. A group in which any sample could not be judged (a verifier returned None) is dropped whole:
   a missing reward would put its siblings' advantages on a different baseline.
5. The reference for the KL term is the checkpoint the stage started from, frozen (with LoRA: the
   policy with its adapters disabled, `_training.reference_policy`).
6. With `env`, a sample is a multi-turn episode (`_episodes.py`, docs/envs.md): advantages over whole
   episodes, the first prompt as the prompt and everything after it as the completion, in the loss
   and the KL only where the model wrote it.
7. Data-parallel (docs/distributed.md): every rank draws the same prompts, generates and scores the
   groups of its contiguous share of them (sampling the random numbers one process would draw for
   those rows, `SamplingParams.shard`), computes advantages within its groups (a group never spans
   ranks), normalizes the loss by the token and sequence counts of every rank's rows, and the
   gradients are summed over the ranks. Not yet with dynamic sampling, `env` or a non-native backend.
8. Asynchronous (`max_staleness` k ≥ 1, docs/async_rl.md): a rollout thread (`_async_rollout.py`) samples
   rollout i with the policy after exactly max(0, i − k) rollout updates while the learner trains, and the
   update applies decoupled PPO with a truncated importance weight (`losses.decoupled_ppo_loss`: Hilton et
   al. 2022, AReaL eq. 5, Yao et al. 2025) whose proximal log-probs are the first pass's own, detached.
   Every run (k = 0 too) logs the sampler/learner mismatch of the first pass (`mismatch/*`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posttrain.data import EpochSampler, Problem
from posttrain.distributed import DistributedError, World, shard_range
from posttrain.envs import Episode, EpisodeEnd, EnvironmentFactory, pad_episodes
from posttrain.losses import (
    AGGREGATIONS,
    GRPO_VARIANTS,
    GRPOLoss,
    LossNormalizer,
    LossVariant,
    decoupled_grpo_token_loss,
    entropy_from_logits,
    grpo_token_loss,
    sampler_mismatch,
    token_logprobs,
)
from posttrain.runtime.config import GRPOStage
from posttrain.runtime.context import RunContext, StageResult, eval_plan
from posttrain.rewards import CombinedRewards, WeightedVerifier
from posttrain.rollout import Rollout, RolloutEngine, SamplingParams
from posttrain.rollout.text import positions_from_mask
from posttrain.stages._async_rollout import (
    AsyncRollouts,
    RolloutItem,
    pending_state,
    producer_worker,
    restore_pending,
    staleness_metrics,
)
from posttrain.stages._episodes import build_env, collect_episode_groups
from posttrain.stages._rlvr import (
    build_rewards,
    close_rewards,
    encode_problems,
    group_keep,
    load_problems,
    load_reward_models,
    passed,
    reward_model_cost,
    score_rollout,
)
from posttrain.stages._learned_reward import resolve_policy
from posttrain.models.prefix_attention import shared_prefix
from posttrain.stages._packing import packed_width, padded_completion_logits, shared_prompt_logprobs
from posttrain.stages._training import (
    Trainer,
    idle_micro_batches,
    micro_batch_sync,
    next_step,
    optimizer_step,
    policy_weights,
    reduce_gradients,
    reference_policy,
    rollout_policy,
    save,
    start_or_resume,
)
from posttrain.telemetry import costs, memory
from posttrain.telemetry.phases import MAIN_WORKER


# ---- the rollout batch ---------------------------------------------------------------------------
@dataclass
class GroupBatch:
    """The sequences one rollout batch trains on, re-padded as one batch. R rows, P prompt, N completion."""

    input_ids: Tensor       # (R, P + N): left-padded prompt, right-padded completion
    attention_mask: Tensor  # (R, P + N) bool
    position_ids: Tensor    # (R, P + N) as the rollout engine used them
    mask: Tensor            # (R, N) bool: completion tokens in the loss
    old_logprobs: Tensor    # (R, N) sampling-time log π_old (raw model, T = 1)
    advantages: Tensor      # (R,)
    prompt_len: int

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, sl: slice) -> GroupBatch:
        return GroupBatch(self.input_ids[sl], self.attention_mask[sl], self.position_ids[sl], self.mask[sl],
                          self.old_logprobs[sl], self.advantages[sl], self.prompt_len)

    @staticmethod
    def empty() -> GroupBatch:
        """No rows: a data-parallel rank none of whose groups is usable this step still takes part in the
        update's collectives (with zero gradients)."""
        return GroupBatch(torch.zeros((0, 2), dtype=torch.long), torch.zeros((0, 2), dtype=torch.bool),
                          torch.zeros((0, 2), dtype=torch.long), torch.zeros((0, 1), dtype=torch.bool),
                          torch.zeros((0, 1)), torch.zeros(0), prompt_len=1)


def build_batch(pieces: list[tuple[Rollout, list[int], Tensor]], pad_id: int, *, mask_truncated: bool) -> GroupBatch:
    """Concatenate the kept rows of several rollouts (each (rollout, rows, advantages (len(rows),)))."""
    prompts, completions, olds, advs, keep = [], [], [], [], []
    for ro, rows, adv in pieces:
        lengths = ro.completion_lengths.tolist()
        for j, r in enumerate(rows):
            prompts.append(ro.prompt_ids[r][ro.prompt_mask[r]])
            completions.append(ro.completion_ids[r, : lengths[r]])
            olds.append(ro.policy_logprobs[r, : lengths[r]])
            keep.append(not (mask_truncated and ro.finish_reason[r] == "length"))
        advs.append(adv)
    p_len, n_len = max(len(p) for p in prompts), max(len(c) for c in completions)
    rows_n = len(prompts)
    ids = torch.full((rows_n, p_len + n_len), pad_id, dtype=torch.long)
    attn = torch.zeros((rows_n, p_len + n_len), dtype=torch.bool)
    old = torch.zeros((rows_n, n_len))
    for i, (p, c, o) in enumerate(zip(prompts, completions, olds)):
        ids[i, p_len - len(p) : p_len], attn[i, p_len - len(p) : p_len] = p, True
        ids[i, p_len : p_len + len(c)], attn[i, p_len : p_len + len(c)] = c, True
        old[i, : len(o)] = o
    mask = attn[:, p_len:] & torch.tensor(keep)[:, None]
    return GroupBatch(ids, attn, positions_from_mask(attn), mask, old, torch.cat(advs).float(), p_len)


def episode_batch(episodes: list[Episode], advantages: Tensor, pad_id: int, *, mask_truncated: bool) -> GroupBatch:
    """Episodes as the batch the update reads: the first prompt is the prompt, the rest (model turns and
    environment text) the completion — in the loss only where the model wrote it (`Episode.model_mask`)."""
    b = pad_episodes(episodes, pad_id)
    keep = torch.tensor([not (mask_truncated and e.end is not EpisodeEnd.DONE) for e in episodes])
    return GroupBatch(b.input_ids, b.attention_mask, b.position_ids, b.mask & keep[:, None], b.old_logprobs,
                      advantages.float(), b.prompt_len)


def completion_logprobs(model: torch.nn.Module, b: GroupBatch, *, share_prompt: bool = False,
                        entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """log π of each completion token. Shape: (R, N) fp32 (filler past a completion's end); with
    `entropy`, also each prediction's entropy, (R, N), detached.

    share_prompt: each group of consecutive rows with the same prompt runs the prompt once and every
    completion at its own length, all packed into one row (`_packing.shared_prompt_logprobs`,
    `models.prefix_attention`); else the padded batch without its last column (the last token predicts
    nothing and nothing attends to it)."""
    if share_prompt:
        return shared_prompt_logprobs(model, b.input_ids, b.attention_mask, b.position_ids, b.prompt_len, entropy=entropy)
    logits = padded_completion_logits(model, b.input_ids, b.attention_mask, b.position_ids, b.mask.shape[1])  # (R, N, V)
    logps = token_logprobs(logits, b.input_ids[:, b.prompt_len :])  # fp32 out; bf16 logits are read as they are
    if not entropy:
        return logps
    with torch.no_grad():
        return logps, entropy_from_logits(logits.detach())


def forward_shape(b: GroupBatch, *, share_prompt: bool) -> tuple[int, int]:
    """(rows, columns) a forward over `b` runs, for the phase's cost: the padded batch less its last column,
    or with share_prompt the packed row's real tokens as R rows of their mean length (exact matmul FLOPs)."""
    if not share_prompt or len(b) == 0:
        return len(b), b.input_ids.shape[1] - 1
    return len(b), math.ceil(packed_width(b.input_ids, b.attention_mask, b.prompt_len) / len(b))


@dataclass
class Collected:
    pieces: list[tuple[Rollout, list[int], Tensor]]
    metrics: dict[str, float]


def collect_groups(ctx: RunContext, cfg: GRPOStage, engine: RolloutEngine, verifiers: list[WeightedVerifier], variant: LossVariant,
                   problems: list[Problem], prompts: list[list[int]], sampler: EpochSampler, step: int,
                   worker: str = MAIN_WORKER) -> Collected:
    """Generate and score groups until `batch_size / group_size` usable ones are in hand (bounded).

    Phases `generate` and `score`. Without dynamic sampling, one round, every judged group kept
    (zero-variance groups have advantage 0 and only count in the normalizers)."""
    g, want = cfg.group_size, cfg.batch_size // cfg.group_size
    ranks = ctx.ranks
    pieces: list[tuple[Rollout, list[int], Tensor]] = []
    kept = generated = zero_var = unjudged = 0
    m: dict[str, float] = {}
    for rnd in range(cfg.max_rounds if cfg.dynamic_sampling else 1):
        need = want - kept
        if need <= 0:
            break
        keep_rate = kept / generated if generated else 1.0
        n_draw = need if rnd == 0 else min(want, math.ceil(need / max(keep_rate, 1 / want)))
        drawn = [sampler.next_batch()[0] for _ in range(n_draw)]  # every rank draws the same prompts
        mine = shard_range(len(drawn), ranks)  # this rank's share of them (all of them in one process)
        idx = [drawn[i] for i in mine]
        params = SamplingParams(n=g, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                                seed=ctx.recipe.seed * 1_000_003 + step * 101 + rnd,
                                shard=None if ranks.world_size == 1 else (mine.start * g, len(drawn) * g))
        with ctx.phase("generate", stage=cfg.folder, step=step, worker=worker) as p:
            ro = engine.generate([prompts[i] for i in idx], params)
            p.cost = engine.decode_cost(batch=len(ro), prompt_len=ro.prompt_ids.shape[1],
                                        new_tokens=max(1, ro.completion_ids.shape[1]), samples=g)
        with ctx.phase("score", stage=cfg.folder, step=step, worker=worker,
                       cost=reward_model_cost(verifiers, len(ro), ro.sequence_ids.shape[1])):
            batch_problems = [problems[i] for i in idx]
            rewards = score_rollout(verifiers, ro, batch_problems)
            judged, varied, missing = group_keep(rewards.total, g)
            total = torch.tensor([0.0 if t is None else t for t in rewards.total])
            adv = variant.advantages(total, group_size=g).reshape(-1, g)                    # (P, G)
        usable = varied if cfg.dynamic_sampling else judged
        groups = usable.nonzero()[:, 0].tolist()[:need]
        for gi in groups:
            pieces.append((ro, list(range(gi * g, gi * g + g)), adv[gi]))
        generated, kept = generated + len(idx), kept + len(groups)
        zero_var += int((judged & ~varied).sum())
        unjudged += int(missing.sum())
        if rnd == 0:  # the first round is an unfiltered sample of the policy: its reward metrics
            m.update(rollout_metrics(ranks, rewards, ro, passed(rewards, verifiers[0].name, cfg.pass_threshold)))
    if ranks.world_size > 1:  # one round (no dynamic sampling): the counts of every rank's groups
        c = ranks.sum({"zero_var": zero_var, "unjudged": unjudged, "generated": generated, "kept": kept})
        zero_var, unjudged, generated, kept = (int(c[k]) for k in ("zero_var", "unjudged", "generated", "kept"))
    m.update({"groups/zero_variance_frac": zero_var / generated, "groups/unjudged": float(unjudged),
              "dynamic/rounds": float(rnd + 1), "dynamic/generated_groups": float(generated),
              "dynamic/kept_groups": float(kept), "dynamic/short_groups": float(want - kept),
              "dynamic/waste_frac": 1 - kept / generated})
    return Collected(pieces, m)


def rollout_metrics(ranks: World, rewards: CombinedRewards, ro: Rollout, passes: list[bool]) -> dict[str, float]:
    """Reward and response metrics of one generation round — of every rank's rows: counts summed, the
    longest response the longest anywhere, means weighted by the rows (or judged rows) they average."""
    lengths = ro.completion_lengths.float()
    rows = len(ro)
    means = {"reward/pass_rate": sum(passes) / rows, "response/length_mean": float(lengths.mean()),
             "response/clipped_ratio": sum(r == "length" for r in ro.finish_reason) / rows}
    weights = dict.fromkeys(means, float(rows))
    counts = rewards.metrics()  # reward/total and reward/<name> are means over judged rows, the rest counts
    weights["reward/total"] = float(rows - rewards.skipped)
    weights.update({f"reward/{name}": float(stats.scored) for name, stats in rewards.stats.items()})
    means.update({k: counts.pop(k, 0.0) for k in weights if k.startswith("reward/") and k != "reward/pass_rate"})
    return {**ranks.sum(counts), **ranks.mean(means, weights),
            **ranks.max({"response/length_max": float(lengths.max())})}


def collect(ctx: RunContext, cfg: GRPOStage, engine: RolloutEngine, verifiers: list[WeightedVerifier],
            variant: LossVariant, problems: list[Problem], prompts: list[list[int]], sampler: EpochSampler, step: int,
            env: EnvironmentFactory | None, worker: str = MAIN_WORKER) -> tuple[GroupBatch | None, dict[str, float]]:
    """One rollout batch — single completions, or episodes in `env` — as the batch the update reads
    (None: no usable group) and its metrics. `worker`: who generates it (a rollout thread: "rollout0")."""
    if env is None:
        got = collect_groups(ctx, cfg, engine, verifiers, variant, problems, prompts, sampler, step, worker)
        return (build_batch(got.pieces, engine.pad_id, mask_truncated=cfg.mask_truncated) if got.pieces else None,
                got.metrics)
    eps = collect_episode_groups(ctx, cfg, engine, env, verifiers, variant.advantages, problems, sampler, step)
    return (episode_batch(eps.episodes, eps.advantages, engine.pad_id, mask_truncated=cfg.mask_truncated)
            if eps.episodes else None, eps.metrics)


# ---- one update ----------------------------------------------------------------------------------
def batch_normalizer(ranks: World, mask: Tensor, *, constant_length: float) -> LossNormalizer:
    """`losses.loss_normalizer` of the whole optimizer batch: the counts of every rank's rows. Shape: mask
    (R, N) of this rank's rows (R may be 0)."""
    c = ranks.sum({"tokens": float(mask.sum()), "rows": float(mask.shape[0])})  # a sync point
    if c["tokens"] == 0:
        raise ValueError(f"loss_normalizer: the batch's masks ({int(c['rows'])} rows) have no tokens; nothing to train on")
    return LossNormalizer(num_tokens=c["tokens"], num_sequences=c["rows"], constant_length=float(constant_length))


def micro_rows(cfg: GRPOStage, ranks: World, rows: int) -> int:
    """Rows per micro-batch of this rank's `rows`: `grad_accum` micro-batches over all ranks."""
    return max(1, math.ceil(rows / math.ceil(cfg.grad_accum / ranks.world_size)))


def update(ctx: RunContext, cfg: GRPOStage, t: Trainer, b: GroupBatch, ref_logps: Tensor | None, variant: LossVariant,
           clip: tuple[float, float], prox: list[Tensor] | None = None) -> dict[str, float]:
    """One optimizer step over the whole batch in `grad_accum` micro-batches; exact accumulation
    (normalizers counted over the whole batch — every rank's rows — first).

    prox: with an off-policy correction (`cfg.correction` ≠ none), the proximal log-probs per micro-batch:
    an empty list on the rollout's first pass, which fills it with that pass's own log-probs, detached (the
    learner's weights before the update — docs/async_rl.md, departure 1); later passes (μ > 1) read them.
    Every pass also measures the sampler/learner mismatch (`mismatch/*`; the stage keeps the first pass's)."""
    norm = batch_normalizer(ctx.ranks, b.mask, constant_length=cfg.max_new_tokens)
    aggregate = AGGREGATIONS[variant.aggregation]
    micro = micro_rows(cfg, ctx.ranks, len(b))
    sums = {"loss/policy": 0.0, "kl": 0.0, "entropy": 0.0, "clip/low": 0.0, "clip/high": 0.0, "clip/approx_kl": 0.0,
            "mismatch/logprob_abs_mean": 0.0, "mismatch/kl": 0.0}
    if prox is not None:
        sums.update({"offpolicy/is_weight_mean": 0.0, "offpolicy/is_truncated_frac": 0.0, "offpolicy/log_ratio_abs_mean": 0.0})
    first_pass = prox is not None and not prox
    ratio_max = 0.0
    tokens = norm.num_tokens
    mine = math.ceil(len(b) / micro)  # FSDP: every rank runs as many micro-batches as the busiest (a sync point)
    count = int(ctx.ranks.max({"micro": mine})["micro"]) if t.sharded else mine
    for j, i in enumerate(range(0, len(b), micro)):
        micro_batch_sync(t, j, count)
        mb, sl = b.rows(slice(i, i + micro)), slice(i, i + micro)
        with ctx.autocast():
            logps, ent = completion_logprobs(t.model, mb, share_prompt=cfg.share_prompt, entropy=True)  # (r, N) each
        ref = None if ref_logps is None else ref_logps[sl]
        share = float(mb.mask.sum()) / tokens  # stats are token means of the micro-batch: weight by tokens
        if prox is None:
            tok_loss, kl, stats = grpo_token_loss(logps, mb.old_logprobs, ref, mb.advantages, mb.mask,
                                                  clip_low=clip[0], clip_high=clip[1], kl_coef=cfg.kl_coef)
        else:
            if first_pass:
                prox.append(logps.detach())
            tok_loss, kl, stats, is_stats = decoupled_grpo_token_loss(
                logps, prox[j], mb.old_logprobs, ref, mb.advantages, mb.mask, clip_low=clip[0], clip_high=clip[1],
                kl_coef=cfg.kl_coef, is_cap=cfg.is_cap)
            for k, v in is_stats.as_floats().items():
                sums[f"offpolicy/{k}"] += v * share
        for k, v in sampler_mismatch(logps, mb.old_logprobs, mb.mask).as_floats().items():
            sums[f"mismatch/{k}"] += v * share
        loss = aggregate(tok_loss, mb.mask, norm)
        # activation checkpointing recomputes each layer's forward inside backward: it must run through the same
        # attention kernel the forward ran (the shared-prefix one), so the switch spans the backward too
        with shared_prefix(t.model) if cfg.share_prompt and cfg.activation_checkpointing else nullcontext():
            loss.backward()
        with torch.no_grad():
            sums["entropy"] += float((ent * mb.mask).sum()) / tokens
            sums["kl"] += float(kl.sum()) / tokens
        f = stats.as_floats()
        sums["loss/policy"] += float(loss.detach())
        sums["clip/low"] += f["clip_frac_low"] * share
        sums["clip/high"] += f["clip_frac_high"] * share
        sums["clip/approx_kl"] += f["approx_kl"] * share
        ratio_max = max(ratio_max, f["ratio_max"])
    idle_micro_batches(t, mine, count, b.input_ids.device)
    reduce_gradients(t, ctx.ranks)  # the step's gradient: every rank's rows (a sync point)
    sums = ctx.ranks.sum(sums)  # each is this rank's part of the whole batch's value
    ratio_max = ctx.ranks.max({"ratio_max": ratio_max})["ratio_max"]
    grad_norm = optimizer_step(t, cfg.optim, {"loss/policy": sums["loss/policy"]})
    return {**sums, **t.guard.metrics(), "clip/ratio_max": ratio_max, "train/grad_norm": grad_norm, "train/lr": t.scheduler.get_last_lr()[0]}


@torch.no_grad()
def reference_logprobs(ref_model: torch.nn.Module, b: GroupBatch, micro: int, *, share_prompt: bool = False) -> Tensor:
    """log π_ref of every completion token. Shape: (R, N)."""
    out = [completion_logprobs(ref_model, b.rows(slice(i, i + micro)), share_prompt=share_prompt)
           for i in range(0, len(b), micro)]
    return torch.cat(out) if out else torch.zeros(b.mask.shape)  # no rows: a data-parallel rank with none


def greedy_eval(ctx: RunContext, model: torch.nn.Module, n: int) -> dict[str, float]:
    """In-stage eval: the recipe's first eval, greedy only, on the first `n` held-out problems of each
    level (`eval/<metric>/<level>`, e.g. eval/exact_match/L2); nothing when the recipe names no eval."""
    plan = eval_plan(ctx.recipe, ctx.tasks)
    if not plan:
        return {}
    spec, task, request = plan[0]
    request = dataclasses.replace(request, per_level=min(n, request.per_level or n), k=(), probe=False, greedy=True)
    records = task.evaluate(model, ctx.tokenizer, request, stage="", checkpoint="")
    return {f"eval/{r.metric}/{r.level or 'all'}": r.value for r in records}


# ---- asynchronous rollouts (docs/async_rl.md) ----------------------------------------------------
def async_data_state(cfg: GRPOStage, pending: list[RolloutItem], waited: float) -> dict[str, Any]:
    """What an async checkpoint saves beside the weights: every rollout already made and not yet trained on
    (their policy versions are gone once the learner moves on) and the sampler where the producer left it."""
    del waited  # the drain's wait: the learner idles once per checkpoint for the rollouts whose versions exist
    return {"sampler": pending[-1].data_state, "async": pending_state(cfg.max_staleness, pending)}


def resumed_rollouts(cfg: GRPOStage, data_state: dict[str, Any] | None, sampler: EpochSampler) -> list[RolloutItem]:
    """Restore the sampler from a checkpoint's data state and return the rollouts an async checkpoint saved."""
    if data_state is None:
        return []
    saved = data_state.get("async")
    pending = restore_pending(cfg.folder, cfg.max_staleness, saved, GroupBatch)  # another k: an error
    sampler.load_state_dict(data_state if saved is None else data_state["sampler"])
    return pending


# ---- the stage -----------------------------------------------------------------------------------
def data_parallel_problem(cfg: GRPOStage, world_size: int) -> str | None:
    """Why this stage cannot run on `world_size` ranks, or None."""
    if world_size == 1:
        return None
    prompts = cfg.batch_size // cfg.group_size
    not_yet = [what for what, on in (("dynamic_sampling", cfg.dynamic_sampling), ("env", cfg.env is not None),
                                     (f"max_staleness {cfg.max_staleness}", cfg.max_staleness > 0),
                                     (f"backend {cfg.backend!r}", cfg.backend != "native")) if on]
    if not_yet:
        return f"{cfg.folder}: {' and '.join(not_yet)} cannot run data-parallel yet ({world_size} ranks); run it in one process"
    if prompts % world_size:
        return (f"{cfg.folder}: {prompts} prompts per rollout (batch_size {cfg.batch_size} / group_size {cfg.group_size}) "
                f"do not split over {world_size} ranks; make them a multiple of {world_size}")
    return None


def run_grpo(cfg: GRPOStage, ctx: RunContext) -> StageResult:
    # ---- setup ---------------------------------------------------------------------------------
    if problem := data_parallel_problem(cfg, ctx.ranks.world_size):
        raise DistributedError(problem)
    tok, stage = ctx.tokenizer, cfg.folder
    variant = GRPO_VARIANTS[GRPOLoss(cfg.loss)]
    clip = (cfg.clip_low or variant.clip_low, cfg.clip_high or variant.clip_high)
    problems = load_problems(ctx, cfg.data, levels=cfg.levels)
    env = build_env(ctx, cfg.env, cfg.data) if cfg.env is not None else None  # episodes: the environment renders the prompts
    if env is not None:
        try:
            env.validate(problems)  # e.g. a code problem without its visible or hidden tests: stop before any step
        except ValueError:
            env.close()
            raise
    prompts = encode_problems(problems, tok, cfg.max_prompt_len) if env is None else []
    verifiers = build_rewards(cfg.rewards)
    load_reward_models(verifiers, ctx, stage)  # a `reward_model` reward: its model, from this run (docs/rlvr.md)
    ctx = dataclasses.replace(ctx, start=resolve_policy(ctx))  # after a reward_model stage: the policy it was built for
    t = start_or_resume(ctx, cfg, data_parallel=True, shardable=True)
    sampler = EpochSampler(len(problems), 1, seed=ctx.recipe.seed)
    pending = resumed_rollouts(cfg, t.data_state, sampler)
    # the sampler's model: the policy itself; FSDP: an unsharded copy, loaded at each sync; async: the rollout
    # thread's own copy (the learner's weights move on while the producer samples an older version)
    sampler_model = copy.deepcopy(t.model).requires_grad_(False) if cfg.max_staleness else rollout_policy(ctx, t)
    engine = ctx.rollout_engine(sampler_model, cfg.backend)
    ref = reference_policy(ctx, t.model) if cfg.kl_coef > 0 else None
    prompts_per_step = cfg.batch_size // cfg.group_size
    ctx.console.print(
        f"{stage}: loss {cfg.loss} ({variant.aggregation}, clip {1 - clip[0]:.2f}–{1 + clip[1]:.2f}), "
        f"{len(problems):,} problems; {prompts_per_step} prompts × G={cfg.group_size} = {cfg.batch_size} sequences "
        f"(≤ {cfg.batch_size * cfg.max_new_tokens:,} completion tokens) per rollout, μ={cfg.mu} optimizer steps each; "
        f"{cfg.steps // cfg.mu} rollouts; T={cfg.temperature}; KL coef {cfg.kl_coef}; "
        f"dynamic sampling {f'on, ≤ {cfg.max_rounds} rounds' if cfg.dynamic_sampling else 'off'}; "
        + (f"{ctx.ranks.world_size} ranks × {prompts_per_step // ctx.ranks.world_size} prompts each; "
           if ctx.ranks.world_size > 1 else "")
        + (f"asynchronous: rollout i sampled by the policy after max(0, i − {cfg.max_staleness}) rollout updates "
           f"(a rollout thread); " if cfg.max_staleness else "")
        + (f"off-policy correction {cfg.correction} (IS weight cap {cfg.is_cap:g}); " if cfg.correction != "none" else "")
        + f"rewards {', '.join(f'{r.name}×{r.weight:g}' for r in cfg.rewards)}"
        + (f"; episodes in env {cfg.env.name!r} (≤ {cfg.env.max_turns} turns of ≤ {cfg.max_new_tokens} tokens, "
           f"≤ {cfg.env.max_tokens} tokens each)" if cfg.env is not None else ""))

    # ---- loop ----------------------------------------------------------------------------------
    metrics: dict[str, float] = {}
    rollouts: AsyncRollouts | None = None
    try:
        if cfg.max_staleness:  # the producer draws from the sampler and scores with the verifiers from here on
            rollouts = AsyncRollouts(
                engine=engine, max_staleness=cfg.max_staleness, n_rollouts=cfg.steps // cfg.mu,
                first_index=pending[-1].index + 1 if pending else t.step // cfg.mu, engine_version=t.step // cfg.mu,
                produce=lambda index, _version: collect(ctx, cfg, engine, verifiers, variant, problems, prompts, sampler,
                                                        (index + 1) * cfg.mu, env, worker=producer_worker(engine)),
                data_state=lambda: copy.deepcopy(sampler.state_dict()),
                phase=lambda name, step: ctx.phase(name, stage=stage, step=step, worker=producer_worker(engine)),
                step_of=lambda index: (index + 1) * cfg.mu, release_memory=cfg.release_rollout_memory, pending=pending)
        with ctx.progress() as bar:
            task = bar.add_task(stage, total=cfg.steps, completed=t.step, info="")
            while t.step < cfg.steps:
                step = t.step + cfg.mu  # the optimizer step this rollout ends on: phases and metrics use it
                index = t.step // cfg.mu  # the rollout update this is (0-based): the policy version it makes is index + 1
                t0 = time.perf_counter()
                if rollouts is None:
                    b, got = collect(ctx, cfg, engine, verifiers, variant, problems, prompts, sampler, step, env)
                    metrics = dict(got)
                    if cfg.release_rollout_memory:  # the engine's weight copies leave the update's memory peak; sync rebuilds them
                        engine.release_memory()
                else:
                    item, waited = rollouts.get(index)
                    b, metrics = item.batch, {**item.metrics, **staleness_metrics(index, item, waited)}
                rows = ctx.ranks.sum({"rows": 0 if b is None else len(b)})["rows"]  # every rank's usable rows
                if b is None and rows > 0:  # data-parallel: other ranks have rows, this one joins with none
                    b = GroupBatch.empty()
                if b is None:  # nothing to learn from: no optimizer step, the schedule moves on
                    for _ in range(cfg.mu):
                        next_step(t)
                else:
                    shape = forward_shape(b, share_prompt=cfg.share_prompt)
                    micro = micro_rows(cfg, ctx.ranks, len(b))
                    ref_logps = None
                    if ref is not None:
                        with ctx.phase("reference", stage=stage, step=step,
                                       cost=costs.forward(ref.config, batch=shape[0], seq_len=shape[1])), ref() as ref_model:
                            ref_logps = reference_logprobs(ref_model, b, micro, share_prompt=cfg.share_prompt)
                    prox: list[Tensor] | None = [] if cfg.correction != "none" else None  # filled by the first pass
                    for it in range(cfg.mu):
                        with ctx.phase("update", stage=stage, step=step,
                                       cost=costs.train_step(t.model.config, batch=shape[0], seq_len=shape[1])):
                            upd = update(ctx, cfg, t, b, ref_logps, variant, clip, prox)
                        metrics.update(upd if it == 0 else {k: upd[k] for k in ("clip/low", "clip/high", "clip/approx_kl",
                                                                                    "clip/ratio_max", "train/grad_norm")})
                        metrics.update(t.guard.metrics())
                    if rollouts is None:
                        with ctx.phase("sync", stage=stage, step=step) as ph:  # the next rollout samples the updated policy
                            ph.cost = costs.Cost(bytes=engine.sync_weights(policy_weights(t)))
                    if step == cfg.mu and not t.sharded:  # once: what the phases' memory peaks are made of (not of DTensor shards yet)
                        ctx.telemetry.note_consumers(stage, step, memory.consumers(
                            weights=t.model, optimizer=t.optimizer, engine=engine,
                            reference=ref.model if ref is not None and not ref.shared else None))
                if rollouts is not None:  # version index + 1 to the producer, even when no step was taken (it waits for it)
                    with ctx.phase("sync", stage=stage, step=step) as ph:  # the learner's part: the snapshot copy
                        ph.cost = costs.Cost(bytes=rollouts.publish(index + 1, t.model))
                metrics["train/seconds_per_rollout"] = time.perf_counter() - t0
                evaluates = bool(cfg.eval_every and ctx.recipe.evals) and (step % cfg.eval_every == 0 or step == cfg.steps)
                if evaluates and ctx.ranks.is_main:
                    with ctx.phase("eval", stage=stage, step=step):
                        metrics.update(greedy_eval(ctx, sampler_model if t.sharded else t.model, cfg.eval_problems))
                # the same steps on every rank (ctx.log is a collective there)
                if (step // cfg.mu) % cfg.log_every == 0 or step == cfg.steps or evaluates:
                    ctx.log(stage, step, metrics)
                bar.update(task, completed=t.step, info=f"reward {metrics.get('reward/total', float('nan')):.3f}  "
                                                       f"pass {metrics['reward/pass_rate']:.2f}")
                if t.step % cfg.save_every == 0 and t.step < cfg.steps:
                    save(ctx, cfg, t, data_state=sampler.state_dict() if rollouts is None else
                         async_data_state(cfg, *rollouts.drain(index + 1)))
    finally:
        if rollouts is not None:  # first: the producer uses the verifiers and the environment
            rollouts.close()
        close_rewards(verifiers)
        if env is not None:
            env.close()

    # ---- save ----------------------------------------------------------------------------------
    final = save(ctx, cfg, t, data_state=sampler.state_dict(), final=True)
    return StageResult(final, {k: v for k, v in metrics.items() if k.startswith(("reward/", "eval/", "loss/"))})
