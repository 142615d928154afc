"""What the optimizer-driven stages share, as functions: AdamW, warmup + cosine, and resumable state.

Resume is exact: a checkpoint holds the weights, the optimizer and scheduler state, every RNG state
and the stage's data position, so a run killed at any moment and resumed ends on the same weights, bit
for bit on the CPU with a fixed seed and thread count (tests/test_resume.py kills real runs to prove it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from posttrain.models import lora
from posttrain.runtime.checkpoint import latest_checkpoint, load_state, save_checkpoint, set_rng_state
from posttrain.runtime.config import OptimConfig, TrainStage
from posttrain.runtime.context import RunContext


# AdamW's fused kernel takes 26 ms a step on tiny-30m (2 CPU threads) where the single-tensor loop takes
# 120 ms; on the 0.9M demo model both cost under 5 ms. The two differ by float round-off (~4e-9 a
# step), and the demo's tiny SFT is chaotic in round-off (held-out L3 exact match 12.5% with the fused
# kernel, 55% with the loop, everything else equal), so below this size "auto" keeps the loop the
# shipped recipes were measured with (docs/rlvr.md).
FUSED_MIN_PARAMETERS = 10_000_000


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; no decay on norms and biases (1-D parameters). Every implementation is deterministic, so
    resume is bitwise whichever `cfg.fused` picks."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = cfg.fused if cfg.fused is not None else sum(p.numel() for p in params) >= FUSED_MIN_PARAMETERS
    if fused:
        try:
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=True)
        except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
            pass
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, foreach=False)


def warmup_cosine(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to lr, then cosine to lr × min_lr_ratio at `total_steps`."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class Trainer:
    """The model, its optimizer and schedule, and where the stage resumes from."""

    model: PreTrainedModel
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int  # optimizer steps already taken
    data_state: dict[str, Any] | None  # the stage's data position, as it saved it


def start_or_resume(ctx: RunContext, cfg: TrainStage,
                    load: Callable[[Path, bool], PreTrainedModel] | None = None, *, heads: tuple[str, ...] = ()) -> Trainer:
    """Load the stage's start checkpoint — or its newest resumable one, restoring the whole state.

    load(path, resuming): the model at `path` (default: `ctx.load_model`); a stage whose model is not
    a causal LM (the reward model's scalar head) passes its own.
    With `model.lora` in the recipe the start checkpoint's weights (merged, if it is itself a LoRA
    checkpoint) are the frozen base and the stage trains a fresh adapter on them — or, on resume, the
    saved one; `heads` (e.g. ("score",)) train in full beside it (docs/lora.md)."""
    resume_from = latest_checkpoint(ctx.stage_dir(cfg.folder))
    loader = load or (lambda path, _: ctx.load_model(path))
    spec = ctx.recipe.model.lora
    if spec is None:
        model = loader(resume_from or ctx.start, resume_from is not None)
    else:
        base = loader(ctx.start, False)
        model = (lora.load_adapter(base, resume_from, trainable=True) if resume_from is not None else
                 lora.wrap(base, r=spec.r, alpha=spec.alpha, dropout=spec.dropout, target_modules=spec.target_modules,
                           heads=heads, base=ctx.start))
    model.train()
    ctx.console.print(describe_trainable(cfg.folder, model))
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = warmup_cosine(optimizer, cfg.optim, cfg.steps)
    if resume_from is None:
        return Trainer(model, optimizer, scheduler, step=0, data_state=None)
    state = load_state(resume_from)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    ctx.console.print(f"[yellow]resuming {cfg.folder} from {resume_from.name} (step {state['step']})")
    return Trainer(model, optimizer, scheduler, step=int(state["step"]), data_state=state.get("data"))


def describe_trainable(stage: str, model: torch.nn.Module) -> str:
    """The start-up line: what trains, and its share of the model."""
    trainable, total = lora.trainable_parameters(model)
    if not lora.is_lora(model):
        return f"{stage}: full fine-tuning, {trainable:,} trainable parameters"
    adapters = sum(p.numel() for p in lora.adapter_parameters(model).values())
    cfg = lora.peft_of(model).peft_config["default"]
    return (f"{stage}: LoRA r={cfg.r} α={cfg.lora_alpha:g} on {', '.join(sorted(cfg.target_modules))}: "
            f"{trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%; adapters {adapters:,}"
            f"{', heads ' + ', '.join(sorted(cfg.modules_to_save)) if cfg.modules_to_save else ''})")


@dataclass
class ReferencePolicy:
    """The stage's start policy, frozen — what DPO, PPO and GRPO measure the policy against.

    Full fine-tuning: a second copy of the start weights. LoRA: the policy itself with its adapters
    disabled (`models.lora.adapters_disabled`), no second copy; the stage's adapter is fresh on the
    start weights, so that is the start policy exactly. Use it as `with ref() as model: …`; the forward
    runs under no_grad in eval mode (dropout off) either way."""

    model: torch.nn.Module
    shared: bool  # True: the policy with adapters disabled

    @property
    def config(self):
        return self.model.config

    @contextmanager
    def __call__(self) -> Iterator[torch.nn.Module]:
        if not self.shared:
            with torch.no_grad():
                yield self.model
            return
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), lora.adapters_disabled(self.model):
                yield self.model
        finally:
            self.model.train(was_training)


def reference_policy(ctx: RunContext, policy: torch.nn.Module) -> ReferencePolicy:
    """The reference for `policy`: itself with adapters disabled (LoRA), else the start checkpoint loaded frozen."""
    if lora.is_lora(policy):
        return ReferencePolicy(policy, shared=True)
    return ReferencePolicy(ctx.load_model(ctx.start).eval().requires_grad_(False), shared=False)


def save(ctx: RunContext, cfg: TrainStage, t: Trainer, *, data_state: dict[str, Any] | None, final: bool = False) -> Path:
    state = {
        "stage": cfg.folder,
        "step": t.step,
        "optimizer": t.optimizer.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        "data": data_state,
    }
    return save_checkpoint(ctx.stage_dir(cfg.folder), t.model, ctx.tokenizer, state, keep_last=cfg.keep_last, final=final)


def optimizer_step(t: Trainer, cfg: OptimConfig) -> float:
    """Clip, step, schedule, zero. Returns the pre-clip gradient norm (a device sync point).

    The clip is `clip_grad_norm_`'s — gradients × min(1, limit / (norm + 1e-6)) — except that a factor of
    exactly 1 (every norm up to ~1e-6 below the limit) skips the multiply, a pass over all gradients
    that would leave them bitwise as they are; a NaN norm still scales (NaN everywhere, as torch does)."""
    params = [p for p in t.model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    coef = cfg.grad_clip / (grad_norm + 1e-6)                              # as torch computes it
    if not bool(coef >= 1.0):
        torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, grad_norm)  # scales each p.grad
    t.optimizer.step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    t.step += 1
    return float(grad_norm)
