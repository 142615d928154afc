"""GRPO's rollout side over multi-turn episodes: groups of episodes, their rewards and metrics.

Each of the step's `batch_size / group_size` problems is played G times in the recipe's environment
(`posttrain.envs.run_episodes`, phases `generate` and `tool`); the stage's verifiers then judge each
episode's last assistant turn (phase `score`), plus any reward the environment gave along the way.
Advantages are group-relative over whole episodes (the variant's advantage function, as for single
completions); the loss and the KL fall only on the model's tokens (`Episode.model_mask`).

Departures from single-turn collection (numbered):
1. One round per rollout: no dynamic sampling yet (the config refuses the combination).
   With `rewards: []` the environment's reward alone is the reward (and decides `reward/pass_rate`).
2. An episode that ended at a budget (turns or tokens) is "truncated": `mask_truncated` leaves it out
   of the loss, as it does a completion cut at `max_new_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.data import EpochSampler, Problem
from posttrain.envs import Budget, EnvironmentFactory, Episode, EpisodeEnd, build_environment, run_episodes
from posttrain.rewards import WeightedVerifier
from posttrain.rollout import RolloutEngine, SamplingParams
from posttrain.runtime.config import DataSource, EnvSpec, GRPOStage, task_names
from posttrain.runtime.context import RunContext
from posttrain.stages._rlvr import group_keep, passed, score_texts
from posttrain.tasks import Capability


def build_env(ctx: RunContext, spec: EnvSpec, data: list[DataSource]) -> EnvironmentFactory:
    """The stage's environment: a registered one by name, or (`name: task`) the one the first data task
    with an environment supplies (`Task.environment`, e.g. arithmetic-tools' calculator), with the
    recipe's `params` as overrides."""
    if spec.name != "task":
        return build_environment(spec.name, **spec.params)
    task = ctx.tasks.first_with(task_names(data), Capability.ENV)
    if task is None:  # the pipeline checks this before anything runs; a direct caller gets the same line
        raise ValueError(f"env: name 'task', but no data source is a task that supplies an environment "
                         f"(data tasks: {task_names(data) or 'none, files only'})")
    return task.environment(**spec.params)


@dataclass
class EpisodeGroups:
    episodes: list[Episode]  # the kept groups' episodes, group-major (G consecutive episodes per problem)
    advantages: Tensor       # (len(episodes),)
    metrics: dict[str, float]


def collect_episode_groups(ctx: RunContext, cfg: GRPOStage, engine: RolloutEngine, factory: EnvironmentFactory,
                           verifiers: list[WeightedVerifier], advantages_fn: Callable[..., Tensor], problems: list[Problem],
                           sampler: EpochSampler, step: int) -> EpisodeGroups:
    """Play `batch_size` episodes (G per problem), score them, keep the judged groups. `advantages_fn`:
    the loss variant's, (rewards (N,), *, group_size) → (N,). The first prompt is the environment's
    `reset` chat; it must leave room in `env.max_tokens` (`max_prompt_len` does not apply)."""
    assert cfg.env is not None
    g, want = cfg.group_size, cfg.batch_size // cfg.group_size
    idx = [sampler.next_batch()[0] for _ in range(want)]
    batch_problems = [problems[i] for i in idx for _ in range(g)]
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=ctx.recipe.seed * 1_000_003 + step * 101)
    budget = Budget(max_turns=cfg.env.max_turns, max_tokens=cfg.env.max_tokens, turn_tokens=cfg.max_new_tokens)
    run = run_episodes(engine, ctx.tokenizer, factory, batch_problems, budget=budget, params=params,
                       tool_wait_s=cfg.env.tool_wait_s, keep_kv=cfg.env.keep_kv, phase=lambda name: ctx.phase(name, stage=cfg.folder, step=step))
    eps = run.episodes
    with ctx.phase("score", stage=cfg.folder, step=step):
        model_tokens = [int(e.model_mask.sum()) for e in eps]
        if verifiers:
            rewards = score_texts(verifiers, [e.final_text for e in eps], batch_problems, model_tokens)
            total = [None if t is None else t + (e.reward or 0.0) for t, e in zip(rewards.total, eps)]
        else:  # `rewards: []`: the environment's reward alone (the code-tools task's hidden tests); none = unjudged
            rewards, total = None, [e.reward for e in eps]
        judged, varied, missing = group_keep(total, g)
        adv = advantages_fn(torch.tensor([0.0 if t is None else t for t in total]), group_size=g).reshape(-1, g)  # (P, G)
    groups = judged.nonzero()[:, 0].tolist()
    kept = [eps[gi * g + j] for gi in groups for j in range(g)]
    m = {**(rewards.metrics() if rewards is not None else {}), **episode_metrics(eps, total)}
    passes = (passed(rewards, verifiers[0].name, cfg.pass_threshold) if rewards is not None else
              [t is not None and t >= cfg.pass_threshold for t in total])
    m.update({"reward/pass_rate": sum(passes) / len(eps),
              "response/length_mean": sum(model_tokens) / len(eps), "response/length_max": float(max(model_tokens)),
              "response/clipped_ratio": sum(e.end is not EpisodeEnd.DONE for e in eps) / len(eps),
              "groups/zero_variance_frac": float((judged & ~varied).sum()) / want,
              "groups/unjudged": float(missing.sum()), "episode/generate_calls": float(run.generate_calls),
              # prompt tokens of all turns' generate calls, and those a kept KV cache spared the prefill
              "episode/prompt_tokens": float(run.prompt_tokens),
              "episode/prefill_tokens_saved": float(run.prefill_tokens_saved)})
    adv_kept = adv[groups].reshape(-1) if groups else torch.zeros(0)
    return EpisodeGroups(kept, adv_kept, m)


def episode_metrics(eps: list[Episode], total: list[float | None]) -> dict[str, float]:
    """Turns, tool use and where the reward came from, over one batch of episodes."""
    n = len(eps)
    used = [e.tool_calls > 0 for e in eps]
    m = {"episode/turns_mean": sum(e.turns for e in eps) / n,
         "episode/tool_calls_mean": sum(e.tool_calls for e in eps) / n,
         "episode/tool_errors": float(sum(e.tool_errors for e in eps)),
         "tool/hidden_probe": float(sum(e.hidden_probes for e in eps)),        # sum over the batch
         "tool/hidden_probe_frac": sum(e.hidden_probes > 0 for e in eps) / n,  # episodes with ≥ 1
         "episode/tool_use_frac": sum(used) / n,
         "episode/tokens_mean": sum(len(e.token_ids) for e in eps) / n,
         "episode/end_turn_budget_frac": sum(e.end is EpisodeEnd.TURN_BUDGET for e in eps) / n,
         "episode/end_token_budget_frac": sum(e.end is EpisodeEnd.TOKEN_BUDGET for e in eps) / n,
         "episode/env_seconds": sum(e.env_seconds for e in eps)}
    env_rewards = [e.reward for e in eps if e.reward is not None]
    if env_rewards:
        m["reward/env"] = sum(env_rewards) / len(env_rewards)
    judged = [(t, u) for t, u in zip(total, used) if t is not None]
    positive = sum(max(t, 0.0) for t, _ in judged)
    if positive > 0:  # the share of the (positive) reward earned by episodes that called a tool
        m["reward/tool_share"] = sum(max(t, 0.0) for t, u in judged if u) / positive
    return m
