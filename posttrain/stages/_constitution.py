"""What the Constitutional AI stages (`constitutional_sl`, `constitutional_rl`) share: where they write,
the feedback model a recipe names, principles sampled reproducibly, compliance counts by the rules.
docs/constitutional_ai.md.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data.records import Problem
from posttrain.judges import (
    CHECKERS,
    ChatLabeler,
    ChatReviser,
    Constitution,
    EndpointBackend,
    Labeler,
    LocalChatBackend,
    Principle,
    Reviser,
    RuleLabeler,
    RuleReviser,
    load_constitution,
)
from posttrain.judges.backend import ChatBackend
from posttrain.models import checkpoint_folder
from posttrain.runtime.config import ConstitutionalRLStage, ConstitutionalSLStage, ConstitutionalStage, FeedbackModel, Recipe
from posttrain.runtime.context import RunContext
from posttrain.rollout import RolloutEngine
from posttrain.stages._rlvr import encode_problems, load_problems
from posttrain.telemetry import costs


def output_path(cfg: ConstitutionalStage, run_dir: Path) -> Path:
    return cfg.output if cfg.output is not None else run_dir / "data" / f"{cfg.folder}.jsonl"


def records_path(cfg: ConstitutionalStage, run_dir: Path) -> Path:
    return cfg.records_output if cfg.records_output is not None else run_dir / "data" / f"{cfg.folder}.records.jsonl"


def produced_paths(recipe: Recipe, run_dir: Path) -> dict[Path, int]:
    """Training-data files the recipe's constitutional stages will write → the writing stage's index."""
    return {output_path(s, run_dir).resolve(): i for i, s in enumerate(recipe.stages)
            if isinstance(s, (ConstitutionalSLStage, ConstitutionalRLStage))}


def load_checked_constitution(cfg: ConstitutionalStage, spec: FeedbackModel) -> Constitution:
    """The stage's constitution; a rule feedback model needs a checker on every principle."""
    c = load_constitution(cfg.constitution)
    unchecked = [p.name for p in c.principles if p.check is None]
    if spec.kind == "rule" and unchecked:
        raise ValueError(f"{cfg.folder}: the rule feedback model needs a `check` on every principle of {c.source}; "
                         f"{unchecked} have none (use kind local or endpoint, or add checks)")
    return c


def chat_backend(spec: FeedbackModel, ctx: RunContext, policy: Any, engine: RolloutEngine) -> ChatBackend:
    """The chat model behind a `local` or `endpoint` feedback model. `checkpoint: policy` is the
    stage's own start model, generating through the stage's engine (self-critique)."""
    if spec.kind == "endpoint":
        return EndpointBackend(spec.base_url or "", spec.model or "", api_key_env=spec.api_key_env, budget=spec.budget,
                               cache_dir=ctx.run_dir / "judge_cache")
    if spec.checkpoint == "policy":
        return LocalChatBackend(policy, ctx.tokenizer, engine=engine, batch_size=spec.batch_size, seed=ctx.recipe.seed)
    return LocalChatBackend.from_checkpoint(checkpoint_folder(spec.checkpoint), batch_size=spec.batch_size, seed=ctx.recipe.seed)


def make_reviser(spec: FeedbackModel, ctx: RunContext, policy: Any, engine: RolloutEngine) -> Reviser:
    if spec.kind == "rule":
        return RuleReviser()
    return ChatReviser(chat_backend(spec, ctx, policy, engine), max_tokens=spec.max_tokens)


def make_labeler(spec: FeedbackModel, ctx: RunContext, policy: Any, engine: RolloutEngine) -> Labeler:
    if spec.kind == "rule":
        return RuleLabeler()
    return ChatLabeler(chat_backend(spec, ctx, policy, engine))


@dataclass
class Setup:
    """What both stages hold before their loop: the constitution, the prompts, the policy and its engine
    (weights synced once, timed as `sync`), the principle stream and where the stage writes."""

    constitution: Constitution
    problems: list[Problem]
    prompts: list[list[int]]
    model: Any
    engine: RolloutEngine
    rng: random.Random
    out_path: Path
    rec_path: Path


def setup(cfg: ConstitutionalStage, ctx: RunContext, spec: FeedbackModel, *, seed_offset: int) -> Setup:
    """Load and check the constitution for `spec` (the reviser or the judge), draw the stage's problems
    (`seed_offset` + 100 × draw: each stage and draw its own problems), load the start policy."""
    constitution = load_checked_constitution(cfg, spec)
    problems = load_problems(ctx, cfg.data, levels=cfg.levels, seed_offset=seed_offset + 100 * cfg.draw)
    prompts = encode_problems(problems, ctx.tokenizer, cfg.max_prompt_len)
    model = ctx.load_model(ctx.start)
    engine = ctx.rollout_engine(model)
    with ctx.phase("sync", stage=cfg.folder, step=1) as ph:
        ph.cost = costs.Cost(bytes=engine.sync_weights(model))
    return Setup(constitution, problems, prompts, model, engine, principle_rng(ctx, cfg),
                 output_path(cfg, ctx.run_dir), records_path(cfg, ctx.run_dir))


def principle_rng(ctx: RunContext, cfg: ConstitutionalStage) -> random.Random:
    """Principles are sampled by a stream seeded by the recipe seed, the stage's name and its draw."""
    return random.Random(f"{ctx.recipe.seed}-{cfg.folder}-{cfg.draw}-principles")


def compliance(constitution: Constitution, problem: Problem, text: str) -> dict[str, bool | None]:
    """Each checked principle's verdict on a reply: True/False, None where it does not apply."""
    out: dict[str, bool | None] = {}
    for p in constitution.checked:
        v = CHECKERS[p.check](problem, text)  # type: ignore[index]
        out[p.name] = v.ok if v.applies else None
    return out


def compliance_rates(verdicts: Sequence[dict[str, bool | None]], prefix: str) -> dict[str, float]:
    """`<prefix>/<principle>`: the compliant share of the replies it applies to; `<prefix>/all`: the
    share of replies compliant with every principle that applies to them."""
    out: dict[str, float] = {}
    names = list(verdicts[0]) if verdicts else []
    for name in names:
        applied = [v[name] for v in verdicts if v[name] is not None]
        if applied:
            out[f"{prefix}/{name}"] = sum(applied) / len(applied)
    if verdicts:
        out[f"{prefix}/all"] = sum(all(x is not False for x in v.values()) for v in verdicts) / len(verdicts)
    return out


def principle_row(p: Principle) -> dict:
    return {"name": p.name, "check": p.check}
