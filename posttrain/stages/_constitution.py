"""What the Constitutional AI stages (`constitutional_sl`, `constitutional_rl`) share: where they write,
the feedback model a recipe names, principles sampled reproducibly, compliance counts by the rules.
docs/constitutional_ai.md.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
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
