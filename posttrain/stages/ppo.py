"""PPO-RLHF: the policy against a learned reward model, under a KL penalty to the start policy.

References: InstructGPT (Ouyang et al. 2022), §3.5 and eq. 2 — maximize r_φ(x, y) − β·log(π(y|x) /
π_SFT(y|x)); Ziegler et al. 2019 (the per-token KL-shaped reward and the adaptive β, §2.2); PPO
(Schulman et al. 2017, eq. 7) with GAE (Schulman et al. 2016). The value function is initialized from
the reward model, as InstructGPT does.

One iteration (`steps` counts iterations), every phase through telemetry:
  generate  — one sampled response per prompt from the policy (rollout engine, KV cache)
  score     — the reward model at the response's last token, normalized (reward_norm.json); the gold
              judge on the same texts (logged only: `gold/reward` beside `rm/score`)
  reference — the frozen start policy's log-probs, and the critic's values at rollout time
  update    — per-token reward = score at the last token − β·KL_t at every token → GAE → `ppo_epochs`
              passes of clipped-surrogate minibatch steps for the policy and clipped-value steps for
              the critic
The KL coefficient is fixed, or adapted toward `kl_target` (Ziegler et al. §2.2).

Departures:
1. Old log-probs are the rollout engine's `policy_logprobs` (the raw model at T = 1, what a training
   forward of the same weights gives), not a second forward; the ratio and the KL use T = 1
   log-probs whatever the sampling temperature.
2. The critic is a separate model (the reward model's weights, own AdamW at `critic_lr`), not a head on
   the policy's trunk, so value-loss gradients never move the policy.
3. A rollout cut by `max_new_tokens` gets `missing_eos_score` instead of its RM score (the
   reward model never saw an unfinished reply; a common guard against length hacking).
4. The learning-rate schedule and `steps` count iterations; each iteration takes
   ppo_epochs × batch_size / minibatch_size optimizer steps of both models.
5. Every optimizer step of either model goes through the numeric guard (`_training.guarded_update`):
   the policy's under `loss/policy`, the critic's under `loss/value`, each with its own count — a
   skipped step leaves that model's weights and moments as they were, and `optim.max_nonfinite_skips`
   skips in a row of one model stop the stage naming the term, the iteration and the minibatch update.
6. Asynchronous (`max_staleness` k ≥ 1, docs/async_rl.md, the PPO section): a rollout thread
   (`_async_rollout.AsyncRollouts`, GRPO's) samples and scores iteration i's rollouts (reward model, gold
   judge) with the policy after exactly max(0, i − k) iterations while the learner trains. The learner
   computes what needs its current weights on the batch it takes: the reference log-probs, the critic's
   values (so GAE and the value clip use today's critic) and π_prox, the policy's log-probs before this
   iteration's update — one more no-grad forward (GRPO's π_prox is free, its first pass runs before any
   optimizer step; PPO's first minibatch step moves the weights before the second minibatch's forward).
   The update is decoupled PPO (`losses.decoupled_ppo_loss`: Hilton et al. 2022; AReaL, Fu et al. 2025,
   eq. 5; the weight min(π_prox/π_behav, C) truncated as in Yao et al. 2025): the clip centred on π_prox,
   each token's surrogate weighted. The KL-shaped reward uses π_prox (the policy being penalized), not
   π_behav; the value loss is not weighted. `off_policy: decoupled` at k = 0 takes the same path (π_prox
   = π_behav up to kernel round-off); `off_policy: none` at k ≥ 1 clips against π_behav, unweighted.

Data-parallel (docs/distributed.md; replicate only): every rank draws the same prompts and generates
its contiguous share of the rollouts (the native engine draws the whole batch's uniforms and keeps its
rows, so the samples are one process's); scores, reference log-probs and values are per row. What spans
the batch is reduced over the ranks: the advantage whitening (mean and variance of every rank's
tokens), the KL statistics the adaptive controller reads, each minibatch's token count (the loss
normalizer), both models' gradients (summed after every minibatch backward) and every logged value.
The minibatch permutation is over the global batch; a rank holds the minibatch's rows it generated
(possibly none: it contributes zeros).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.data import EpochSampler, encode_prompt, read_jsonl
from posttrain.distributed import DistributedError, World, all_reduce_gradients, check_replicas_agree, shard_range
from posttrain.data.records import Problem
from posttrain.losses import (
    AdaptiveKLController,
    FixedKLController,
    LossNormalizer,
    PolicyStats,
    clipped_value_loss,
    decoupled_ppo_loss,
    entropy_from_logits,
    gae,
    kl_penalty_rewards,
    loss_normalizer,
    masked_whiten,
    ppo_clip_loss,
    sampler_mismatch,
    token_logprobs,
    token_mean,
)
from posttrain.models import lora
from posttrain.models.heads import (
    load_scalar_model,
    token_scores,
)
from posttrain.runtime.config import PPOStage
from posttrain.runtime.context import RunContext, StageResult
from posttrain.rollout import Rollout, SamplingParams
from posttrain.stages._async_rollout import AsyncRollouts, RolloutItem, pending_state, producer_worker, restore_pending, staleness_metrics
from posttrain.stages._gold_eval import compare_to_reference, gold_task
from posttrain.stages._learned_reward import (
    RewardModelScorer,
    resolve_policy,
    resolve_reward_model,
)
from posttrain.stages._packing import padded_completion_logits
from posttrain.stages._training import (
    NumericGuard,
    ReferencePolicy,
    Trainer,
    build_optimizer,
    describe_trainable,
    guarded_update,
    next_step,
    reference_policy,
    save,
    start_or_resume,
    warmup_cosine,
)
from posttrain.tasks import Capability, Task
from posttrain.telemetry import costs, memory
from posttrain.telemetry.phases import MAIN_WORKER


def load_prompts(ctx: RunContext, cfg: PPOStage) -> list[Problem]:
    """Prompts as problems: a `problem` file's rows, or a task's (the arithmetic task's carry a, op, b
    for its gold judge)."""
    rows: list[Problem] = []
    for src in cfg.data:
        if src.path is not None:
            rows += read_jsonl(src.path, "problem").records  # type: ignore[arg-type]
        else:
            rows += ctx.tasks.get(src.task).records("problem", src.n, seed_offset=3, levels=cfg.levels)  # type: ignore[arg-type]
    return rows


def completion_logits(model, r: Rollout) -> Tensor:
    """Logits predicting each completion token. Shape: (R, N, V)."""
    return padded_completion_logits(model, r.sequence_ids, r.sequence_mask, r.position_ids, r.completion_ids.shape[1])


def completion_values(critic, r: Rollout) -> Tensor:
    """V(s_t) for each completion token t: the critic at the position that predicts it. Shape: (R, N)."""
    p = r.prompt_ids.shape[1]
    return token_scores(critic, r.sequence_ids[:, :-1], r.sequence_mask[:, :-1], r.position_ids[:, :-1])[:, p - 1 :]


def trainable_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """What a checkpoint must hold of the critic: every weight, or with LoRA only what trains (the base is the reward model's)."""
    if not lora.is_lora(model):
        return model.state_dict()
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 − Var(R − V) / Var(R) over masked-in tokens (1: perfect critic, 0: no better than a constant)."""
    keep = mask.bool()
    v, ret = values[keep], returns[keep]
    var = ret.var()
    return float(1 - (ret - v).var() / var) if var > 0 else float("nan")


def data_parallel_problem(cfg: PPOStage, world_size: int) -> str | None:
    """Why this stage cannot run on `world_size` ranks, or None."""
    if world_size > 1 and (cfg.max_staleness or cfg.correction != "none"):  # the rollout thread and the offpolicy/* stats are one process's
        return (f"{cfg.folder}: max_staleness {cfg.max_staleness} / off_policy {cfg.correction} cannot run data-parallel yet "
                f"({world_size} ranks); set max_staleness: 0 and off_policy: none, or run it in one process")
    if world_size > 1 and cfg.batch_size % world_size:
        return (f"{cfg.folder}: batch_size {cfg.batch_size} rollouts do not split over {world_size} ranks; "
                f"make it a multiple of {world_size}")
    return None


def whiten_over_ranks(ranks: World, values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """`losses.masked_whiten` of every rank's rows together: (x − μ) / sqrt(σ² + eps), μ and the unbiased
    σ² over all ranks' masked-in tokens (two sums of float64 scalars over the ranks); 0 where mask is 0.
    One process: masked_whiten itself. Shape: this rank's (R, N)."""
    if ranks.world_size == 1:
        return masked_whiten(values, mask)
    keep = mask.bool()
    values = values.detach()
    c = ranks.sum({"n": float(keep.sum()), "sum": float(values[keep].double().sum())})  # a sync point
    if c["n"] < 2:
        raise ValueError(f"whiten_over_ranks: needs at least 2 masked-in elements for a variance, got {c['n']:.0f}")
    mean = c["sum"] / c["n"]
    var = ranks.sum({"ss": float(((values[keep].double() - mean) ** 2).sum())})["ss"] / (c["n"] - 1)
    return torch.where(keep, (values - mean) / math.sqrt(var + eps), 0.0)


def explained_variance_over_ranks(ranks: World, values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """`explained_variance` over every rank's tokens (float64 sums reduced over the ranks)."""
    if ranks.world_size == 1:
        return explained_variance(values, returns, mask)
    keep = mask.bool()
    ret, diff = returns[keep].double(), (returns - values)[keep].double()
    c = ranks.sum({"n": float(keep.sum()), "r": float(ret.sum()), "rr": float((ret ** 2).sum()),
                   "d": float(diff.sum()), "dd": float((diff ** 2).sum())})
    if c["n"] < 2:
        return float("nan")
    var_r = (c["rr"] - c["r"] ** 2 / c["n"]) / (c["n"] - 1)
    var_d = (c["dd"] - c["d"] ** 2 / c["n"]) / (c["n"] - 1)
    return float(1 - var_d / var_r) if var_r > 0 else float("nan")


def reduce_stats(ranks: World, stats: dict[str, float], weight: float) -> dict[str, float]:
    """A minibatch's logged values over the ranks: maxima of maxima, the rest means weighted by each
    rank's tokens (`weight`); a loss or entropy already normalized by the global minibatch is summed."""
    summed = {k: v for k, v in stats.items() if k in ("loss/policy", "loss/value", "entropy")}
    maxima = {k: v for k, v in stats.items() if k.endswith("_max")}
    means = {k: v for k, v in stats.items() if k not in summed and k not in maxima}
    out = {**ranks.sum(summed), **ranks.max(maxima), **ranks.mean(means, dict.fromkeys(means, weight))}
    return {k: out[k] for k in stats if k in out}


@dataclass
class PPOBatch:
    """One iteration's rollouts as the rollout side hands them to the learner: sampled and scored. What
    needs the learner's current weights (reference log-probs, values, π_prox) the learner computes."""

    rollout: Rollout             # this rank's R rows
    rm_score: Tensor             # (R,) normalized reward-model score
    score: Tensor                # (R,) the reward the update uses (missing_eos_score on truncated rows)
    truncated: Tensor            # (R,) bool: cut by max_new_tokens
    golds: list[float | None]    # (R,) the gold judge's reward (logged only), [] without one
    rows: range                  # this rank's rows of the iteration's drawn prompts
    n_drawn: int                 # prompts drawn by every rank together (the global batch)


def collect(ctx: RunContext, cfg: PPOStage, engine, scorer: RewardModelScorer, gold: Task | None, problems: list[Problem],
            prompt_ids: list[list[int]], sampler: EpochSampler, step: int, worker: str = MAIN_WORKER) -> PPOBatch:
    """Phases `generate` and `score` of iteration `step`: one sampled response per drawn prompt (this rank's
    share of them), scored by the reward model and the gold judge. `worker`: who runs it (a rollout thread:
    "rollout0")."""
    drawn = list(sampler.next_batch())
    mine = shard_range(len(drawn), ctx.ranks)  # this rank's rollouts (all of them in one process)
    index = [drawn[i] for i in mine]
    with ctx.phase("generate", stage=cfg.folder, step=step, worker=worker) as ph:
        params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, seed=ctx.recipe.seed * 100_003 + step,
                                shard=None if ctx.ranks.world_size == 1 else (mine.start, len(drawn)))
        r = engine.generate([prompt_ids[i] for i in index], params)
        ph.cost = engine.decode_cost(batch=len(r), prompt_len=r.prompt_ids.shape[1], new_tokens=r.completion_ids.shape[1])
    truncated = torch.tensor([f == "length" for f in r.finish_reason], device=r.completion_mask.device)
    with ctx.phase("score", stage=cfg.folder, step=step, worker=worker,
                   cost=costs.forward(scorer.model.config, batch=len(r), seq_len=r.sequence_ids.shape[1], logits="scalar")), torch.no_grad():
        rm_score = scorer(r)  # (R,)
        score = rm_score if cfg.missing_eos_score is None else torch.where(truncated, cfg.missing_eos_score, rm_score)
        golds = gold.gold_rewards([problems[i] for i in index], r.texts, r.finish_reason) if gold else []
    return PPOBatch(r, rm_score, score, truncated, golds, mine, len(drawn))


def async_rollouts(ctx: RunContext, cfg: PPOStage, engine, t: Trainer, pending: list[RolloutItem],
                   produce, sampler: EpochSampler) -> AsyncRollouts:
    """The rollout thread (docs/async_rl.md, PPO): iteration i's rollouts sampled with the policy after
    exactly max(0, i − k) iterations, and scored, while the learner trains."""
    worker = producer_worker(engine)
    return AsyncRollouts(
        engine=engine, max_staleness=cfg.max_staleness, n_rollouts=cfg.steps,
        first_index=pending[-1].index + 1 if pending else t.step, engine_version=t.step,
        produce=lambda index, _version: (produce(index + 1, worker), {}),
        data_state=lambda: copy.deepcopy(sampler.state_dict()),
        phase=lambda name, step: ctx.phase(name, stage=cfg.folder, step=step, worker=worker),
        step_of=lambda index: index + 1, release_memory=cfg.release_rollout_memory, pending=pending)


def run_ppo(cfg: PPOStage, ctx: RunContext) -> StageResult:
    # ---- setup ---------------------------------------------------------------------------------
    if problem := data_parallel_problem(cfg, ctx.ranks.world_size):
        raise DistributedError(problem)
    ranks = ctx.ranks
    tok, seed = ctx.tokenizer, ctx.recipe.seed
    rm_path = resolve_reward_model(ctx, cfg.reward_model, cfg.folder)
    scorer = RewardModelScorer(rm_path, ctx.device, batch_rows=None)  # the reward: frozen, normalized
    norm = scorer.norm
    ctx = dataclasses.replace(ctx, start=resolve_policy(ctx, norm))
    problems = load_prompts(ctx, cfg)
    prompt_ids = [encode_prompt(p, tok, cfg.max_prompt_len) for p in problems]
    gold = gold_task(ctx, cfg.folder, cfg.data, "gold/reward beside rm/score and the gold comparison")
    t = start_or_resume(ctx, cfg, data_parallel=True)
    reference = reference_policy(ctx, t.model)
    critic = load_scalar_model(rm_path, device=ctx.device)
    if lora.is_lora(t.model):  # the critic gets its own fresh adapter; its scalar head trains in full
        spec = ctx.recipe.model.lora
        critic = lora.wrap(critic, r=spec.r, alpha=spec.alpha, dropout=spec.dropout, target_modules=spec.target_modules,
                           heads=("score",), base=rm_path)
        ctx.console.print(describe_trainable(f"{cfg.folder} critic", critic))
    critic.train()
    critic_optim_cfg = cfg.optim.model_copy(update={"lr": cfg.critic_lr})
    critic_opt = build_optimizer(critic, critic_optim_cfg)
    critic_sched = warmup_cosine(critic_opt, critic_optim_cfg, cfg.steps)
    critic_t = Trainer(critic, critic_opt, critic_sched, step=t.step, data_state=None, name=f"{cfg.folder} critic",
                       guard=NumericGuard(cfg.optim.max_nonfinite_skips), stage_dir=t.stage_dir, say=t.say)
    kl_ctl = (AdaptiveKLController(cfg.kl_coef, target=cfg.kl_target, horizon=cfg.kl_horizon)
              if cfg.kl_target is not None else FixedKLController(cfg.kl_coef))
    sampler = EpochSampler(len(problems), cfg.batch_size, seed=seed)
    pending: list[RolloutItem] = []
    if t.data_state is not None:
        pending = restore_pending(cfg.folder, cfg.max_staleness, t.data_state.get("async"), PPOBatch)
        sampler.load_state_dict(t.data_state["sampler"])
        critic.load_state_dict(t.data_state["critic"], strict=not lora.is_lora(critic))
        critic_opt.load_state_dict(t.data_state["critic_optimizer"])
        critic_sched.load_state_dict(t.data_state["critic_scheduler"])
        kl_ctl.load_state_dict(t.data_state["kl"])
        if "critic_guard" in t.data_state:  # absent in checkpoints written before PPO was guarded
            critic_t.guard.load_state_dict(t.data_state["critic_guard"])
    # async: the rollout thread samples its own copy (the learner's weights move on while it samples an older version)
    engine = ctx.rollout_engine(copy.deepcopy(t.model).requires_grad_(False) if cfg.max_staleness else t.model)
    minibatches = cfg.batch_size // cfg.minibatch_size
    ctx.console.print(
        f"{cfg.folder}: policy {ctx.start}, reward model {rm_path} (normalized: mean {norm.mean:.3f}, std {norm.std:.3f}); "
        f"{len(problems):,} prompts; {cfg.batch_size} rollouts per iteration → {cfg.ppo_epochs} epochs × {minibatches} "
        f"minibatches = {cfg.ppo_epochs * minibatches} optimizer steps per model; KL β {kl_ctl.value:g}"
        f"{f' adaptive to {cfg.kl_target}' if cfg.kl_target else ' fixed'}"
        + (f"; {ranks.world_size} ranks × {cfg.batch_size // ranks.world_size} rollouts each" if ranks.world_size > 1 else "")
        + (f"; asynchronous: iteration i sampled by the policy after max(0, i − {cfg.max_staleness}) iterations "
           f"(a rollout thread)" if cfg.max_staleness else "")
        + (f"; off-policy correction {cfg.correction} (IS weight cap {cfg.is_cap:g})" if cfg.correction != "none" else ""))

    def data_state() -> dict:
        return {"sampler": sampler.state_dict(), "critic": trainable_state(critic), "critic_optimizer": critic_opt.state_dict(),
                "critic_scheduler": critic_sched.state_dict(), "kl": kl_ctl.state_dict(), "critic_guard": critic_t.guard.state_dict()}

    def produce(step: int, worker: str = MAIN_WORKER) -> PPOBatch:
        return collect(ctx, cfg, engine, scorer, gold, problems, prompt_ids, sampler, step, worker)

    # ---- loop ----------------------------------------------------------------------------------
    metrics: dict[str, float] = {}
    rollouts = async_rollouts(ctx, cfg, engine, t, pending, produce, sampler) if cfg.max_staleness else None
    try:
        with ctx.progress() as bar:
            task = bar.add_task(cfg.folder, total=cfg.steps, completed=t.step, info="")
            while t.step < cfg.steps:
                step, t0 = t.step + 1, time.perf_counter()
                if rollouts is None:
                    b, async_m = produce(step), {}
                else:  # iteration `step` trains on rollout step − 1, sampled by version max(0, step − 1 − k)
                    item, waited = rollouts.get(step - 1)
                    b, async_m = item.batch, staleness_metrics(step - 1, item, waited)
                r, mine, rm_score, score, truncated = b.rollout, b.rows, b.rm_score, b.score, b.truncated
                seq_len, mask = r.sequence_ids.shape[1], r.completion_mask.float()  # mask (R, N)
                fwd_len = seq_len - 1  # the policy, reference and critic forwards leave the last token out
                decoupled = cfg.correction != "none"
                with ctx.phase("reference", stage=cfg.folder, step=step,
                               cost=costs.forward(reference.config, batch=len(r), seq_len=fwd_len) * (2 if decoupled else 1)
                               + costs.forward(critic.config, batch=len(r), seq_len=fwd_len, logits="scalar")), torch.no_grad(), ctx.autocast():
                    with reference() as ref_model:
                        ref_logps = token_logprobs(completion_logits(ref_model, r), r.completion_ids)  # (R, N)
                    old_values = completion_values(critic, r)  # (R, N): the learner's critic now (async: not the sampler's time)
                    # π_prox: the learner's policy before this iteration's update (one more forward; GRPO's is free)
                    prox_logps = token_logprobs(completion_logits(t.model, r), r.completion_ids) if decoupled else None  # (R, N)
                behav_logps = r.policy_logprobs  # (R, N), departure 1: the sampler's log-probs
                old_logps = behav_logps if prox_logps is None else prox_logps  # the clip's centre and the KL penalty's π
                rewards, kl_stats = kl_penalty_rewards(score, old_logps, ref_logps, mask, kl_coef=kl_ctl.value)
                advantages, returns = gae(rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.lam)
                if cfg.whiten_advantages:
                    advantages = whiten_over_ranks(ranks, advantages, mask)
                update_cost = (costs.train_step(t.model.config, batch=len(r), seq_len=fwd_len)
                               + costs.train_step(critic.config, batch=len(r), seq_len=fwd_len, logits="scalar")) * cfg.ppo_epochs
                if cfg.release_rollout_memory and rollouts is None:  # the engine's weight copies leave the update's memory peak; sync rebuilds them
                    engine.release_memory()
                with ctx.phase("update", stage=cfg.folder, step=step, cost=update_cost):
                    gen = torch.Generator().manual_seed(seed * 7919 + step)
                    stats: list[dict[str, float]] = []
                    t.guard.begin_step()
                    critic_t.guard.begin_step()
                    for epoch in range(cfg.ppo_epochs):
                        order = torch.randperm(b.n_drawn, generator=gen)  # over the global batch
                        for k in range(minibatches):
                            picked = order[k * cfg.minibatch_size : (k + 1) * cfg.minibatch_size]
                            mb = picked[(picked >= mine.start) & (picked < mine.stop)] - mine.start  # this rank's rows of it
                            sub = select(r, mb) if len(mb) else r
                            m = mask[mb]
                            norm_mb = (loss_normalizer(m) if ranks.world_size == 1 else  # the global minibatch's tokens
                                       LossNormalizer(num_tokens=ranks.sum({"t": float(m.sum())})["t"], num_sequences=float(len(picked)), constant_length=None))
                            where = f"update {epoch * minibatches + k + 1} of {cfg.ppo_epochs * minibatches}"
                            mb_stats: dict[str, float] = {}
                            if len(mb):  # a rank may hold none of this minibatch's rows: it contributes zeros
                                with ctx.autocast():
                                    logits = completion_logits(t.model, sub)  # (b, N, V)
                                    logps = token_logprobs(logits, sub.completion_ids)
                                    if prox_logps is None:
                                        pl, pstats = ppo_clip_loss(logps, old_logps[mb], advantages[mb], m, clip_low=cfg.clip, clip_high=cfg.clip)
                                    else:  # decoupled PPO: the clip against π_prox, each token weighted by min(π_prox/π_behav, C)
                                        pl, pstats, is_stats = decoupled_ppo_loss(logps, prox_logps[mb], behav_logps[mb], advantages[mb], m,
                                                                                  clip_low=cfg.clip, clip_high=cfg.clip, is_cap=cfg.is_cap)
                                        mb_stats.update({f"offpolicy/{k}": v for k, v in is_stats.as_floats().items()})
                                    policy_loss = token_mean(pl, m, norm_mb)
                                policy_loss.backward()
                                mb_stats.update({"loss/policy": policy_loss.item(), **{f"policy/{k}": v for k, v in pstats.as_floats().items()}})
                                with torch.no_grad():
                                    mb_stats["entropy"] = token_mean(entropy_from_logits(logits.detach()), m, norm_mb).item()
                            all_reduce_gradients(ranks, t.model)  # a sync point (identity in one process)
                            p_loss = ranks.sum({"p": mb_stats.get("loss/policy", 0.0)})["p"]
                            policy_grad = guarded_update(t, cfg.optim, {"loss/policy": p_loss}, step=step, where=where)
                            if len(mb):
                                with ctx.autocast():
                                    vl, vstats = clipped_value_loss(completion_values(critic, sub), old_values[mb], returns[mb], m, clip=cfg.value_clip)
                                    value_loss = token_mean(vl, m, norm_mb)
                                value_loss.backward()
                                mb_stats.update({"loss/value": value_loss.item(), "value/clip_frac": vstats.as_floats()["clip_frac"]})
                            all_reduce_gradients(ranks, critic)
                            v_loss = ranks.sum({"v": mb_stats.get("loss/value", 0.0)})["v"]
                            guarded_update(critic_t, cfg.optim, {"loss/value": v_loss}, step=step, where=where)
                            if ranks.world_size > 1:  # every rank the same keys: zeros weighted by 0 tokens where it held no rows
                                keys = ["loss/policy", "entropy", "loss/value", "value/clip_frac"] + [f"policy/{k}" for k in PolicyStats.__dataclass_fields__]
                                mb_stats = reduce_stats(ranks, {k: mb_stats.get(k, 0.0) for k in keys}, float(m.sum()))
                            stats.append({**mb_stats, "train/grad_norm": policy_grad})
                    next_step(t)
                    next_step(critic_t)
                if rollouts is None:
                    with ctx.phase("sync", stage=cfg.folder, step=step) as ph:  # the next rollout samples the updated policy
                        ph.cost = costs.Cost(bytes=engine.sync_weights(t.model))
                else:  # version `step` to the producer; the learner's part is the snapshot copy
                    with ctx.phase("sync", stage=cfg.folder, step=step) as ph:
                        ph.cost = costs.Cost(bytes=rollouts.publish(step, t.model))
                if step == 1:  # once: what the phases' memory peaks are made of
                    ctx.telemetry.note_consumers(cfg.folder, step, memory.consumers(
                        weights=t.model, optimizer=t.optimizer, reference=None if reference.shared else reference.model,
                        engine=engine, extra={
                            "critic + its optimizer state": memory.tensor_bytes(critic.parameters())
                            + memory.optimizer_state_bytes(critic_opt)}))
                kl = kl_stats.as_floats()
                known = [g for g in b.golds if g is not None]
                metrics = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}
                rows = {"rm/score": rm_score.mean().item(), "rm/score_raw": (rm_score * norm.std + norm.mean).mean().item(),
                        "objective/score": kl["score"], "kl": kl["kl"], "objective/non_score_reward": kl["non_score_reward"],
                        "response/length": r.completion_lengths.float().mean().item(), "response/truncated": truncated.float().mean().item()}
                rows = ranks.mean(rows, dict.fromkeys(rows, float(len(r))))  # means over every rank's rollouts
                gold_sums = ranks.sum({"n": len(known), "reward": sum(known), "correct": sum(g > 0 for g in known)})
                metrics.update({
                    **rows, "kl_coef": kl_ctl.value,
                    "value/explained_variance": explained_variance_over_ranks(ranks, old_values, returns, mask),
                    "train/lr": t.scheduler.get_last_lr()[0], "train/rollouts_per_s": b.n_drawn / (time.perf_counter() - t0),
                    **t.guard.metrics(), **critic_t.guard.metrics("critic"), **async_m})
                if prox_logps is not None:  # the sampler against the learner before the update (async: the policy's drift too)
                    metrics.update({f"mismatch/{k}": v for k, v in sampler_mismatch(prox_logps, behav_logps, mask).as_floats().items()})
                if gold_sums["n"]:
                    metrics.update({"gold/reward": gold_sums["reward"] / gold_sums["n"], "gold/correct": gold_sums["correct"] / gold_sums["n"]})
                kl_ctl.update(rows["kl"], n_steps=b.n_drawn)
                if (step == cfg.steps and cfg.eval_per_level and gold is not None and gold.has(Capability.EVALS)
                        and ranks.is_main):  # rank 0 alone: the ranks hold the same weights
                    metrics.update(gold_comparison(ctx, cfg, gold, t.model, reference, step))
                if step == 1 or step % cfg.log_every == 0 or step == cfg.steps:
                    ctx.log(cfg.folder, step, metrics)
                bar.update(task, completed=step, info=f"rm {metrics['rm/score']:+.2f}  gold {metrics.get('gold/reward', float('nan')):.2f}  kl {rows['kl']:.2f}")
                if step % cfg.save_every == 0 and step < cfg.steps:
                    check_replicas_agree(ranks, critic, f"{cfg.folder} critic step {step}")  # `save` checks the policy
                    if rollouts is None:
                        save(ctx, cfg, t, data_state=data_state())
                    else:  # the made, untrained rollouts and the sampler where the producer left it (docs/async_rl.md)
                        made, _ = rollouts.drain(step)
                        save(ctx, cfg, t, data_state={**data_state(), "sampler": made[-1].data_state,
                                                      "async": pending_state(cfg.max_staleness, made)})
    finally:
        if rollouts is not None:  # the producer uses the reward model and the engine
            rollouts.close()

    # ---- save ----------------------------------------------------------------------------------
    check_replicas_agree(ranks, critic, f"{cfg.folder} critic step {t.step}")  # `save` checks the policy
    final = save(ctx, cfg, t, data_state=data_state(), final=True)
    summary = {k: v for k, v in metrics.items() if k.startswith(("eval/", "rm/", "gold/", "kl"))}
    return StageResult(final, summary)


def select(r: Rollout, rows: Tensor) -> Rollout:
    """The rollout's rows `rows` (a minibatch), every field indexed alike."""
    keep = rows.tolist()
    return Rollout(prompt_ids=r.prompt_ids[rows], prompt_mask=r.prompt_mask[rows], completion_ids=r.completion_ids[rows],
                   completion_mask=r.completion_mask[rows], logprobs=r.logprobs[rows], policy_logprobs=r.policy_logprobs[rows],
                   finish_reason=[r.finish_reason[i] for i in keep], prompt_index=r.prompt_index[rows],
                   texts=[r.texts[i] for i in keep])


def gold_comparison(ctx: RunContext, cfg: PPOStage, gold: Task, model, reference: ReferencePolicy, step: int) -> dict[str, float]:
    """The policy against the start policy on held-out problems, judged by the task's gold reward. With LoRA
    the start policy is loaded for this once (its sampler cannot share the policy's merged decode weights)."""
    with ctx.phase("eval", stage=cfg.folder, step=step):
        reference = ctx.load_model(ctx.start) if reference.shared else reference.model
        h2h = compare_to_reference(model, reference, ctx.tokenizer, gold.heldout_problems(cfg.eval_per_level), gold,
                                   temperature=cfg.eval_temperature, samples=cfg.eval_samples,
                                   max_new_tokens=cfg.max_new_tokens, seed=ctx.recipe.seed + 7)
    return h2h.metrics("eval/h2h")
