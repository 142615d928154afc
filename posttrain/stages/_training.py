"""What the optimizer-driven stages share, as functions: AdamW, warmup + cosine, resumable state, and
the numeric guard.

Resume is exact: a checkpoint holds the weights, the optimizer and scheduler state, every RNG state
and the stage's data position, so a run killed at any moment and resumed ends on the same weights, bit
for bit on the CPU with a fixed seed and thread count (tests/test_resume.py kills real runs to prove it).

Numeric guard: `guarded_update` skips an optimizer update when a loss the stage passes or the gradient
norm is not finite — no parameter, optimizer moment or gradient of that update survives — counts it,
says why, and after `optim.max_nonfinite_skips` skips in a row stops the stage (`NonFiniteError`, one
line naming what went non-finite first and at which step); the last checkpoint written stays the
newest. `optimizer_step` is one guarded update per stage step; PPO takes several per step, for the
policy and for the critic (each a `Trainer` with its own guard), and calls `guarded_update` itself.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from posttrain.distributed import DistributedError, World, all_reduce_gradients, check_replicas_agree
from posttrain.distributed.fsdp import (
    full_state_dict,
    gradient_norm,
    gradient_sync,
    idle_backward,
    is_sharded,
    load_shards,
    load_whole_optimizer_state,
    shard_model,
)
from posttrain.models import lora
from posttrain.runtime.checkpoint import (
    SHARDS_DIR,
    checkpoint_name,
    is_sharded_checkpoint,
    latest_checkpoint,
    load_state,
    save_checkpoint,
    save_sharded_checkpoint,
    set_rng_state,
)
from posttrain.runtime.config import OptimConfig, TrainStage
from posttrain.runtime.context import RunContext
from posttrain.stages._adamw import AdamW


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
    if fused:  # PyTorch's fused kernel, through ours on a CPU (bit-identical; stages/_adamw.py)
        try:
            return AdamW(groups, lr=cfg.lr, betas=cfg.betas)
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


class NonFiniteError(ValueError):
    """A stage stopped because too many optimizer steps in a row had a non-finite loss or gradient."""


@dataclass
class NumericGuard:
    """Optimizer steps skipped for a non-finite loss or gradient norm: counted, with the reason kept."""

    limit: int = 3  # skips in a row that stop the stage
    skipped: int = 0  # skipped steps in the whole stage (resumed runs carry the count on)
    in_a_row: int = 0
    first: str | None = None  # what went non-finite first in the current run of skips, and at which step
    reason: str | None = None  # why an update of the current stage step was skipped, the first (None: none was)

    def check(self, step: int, losses: dict[str, float], grad_norm: float, where: str = "") -> str | None:
        """Why the update at step `step` (`where` in it, e.g. "update 2 of 4") must be skipped, or None
        when every value is finite. Losses are named first: a NaN loss makes the gradient NaN too, and
        the loss term is the cause worth naming."""
        at = f"at step {step}" + (f" ({where})" if where else "")
        for name, value in losses.items():
            if not math.isfinite(value):
                return f"{name} = {value} {at}"
        if not math.isfinite(grad_norm):
            return f"gradient norm = {grad_norm} {at}"
        return None

    def begin_step(self) -> None:
        """A new stage step: the previous one's skip reason is no longer this step's."""
        self.reason = None

    def record(self, reason: str | None) -> None:
        if reason is None:
            self.in_a_row, self.first = 0, None
            return
        self.reason = self.reason or reason
        self.skipped += 1
        self.in_a_row += 1
        self.first = self.first or reason

    def metrics(self, prefix: str = "train") -> dict[str, float | str]:
        """This step's metrics.jsonl keys: the running count of skipped updates, whether an update of this
        step was skipped, and why (the first)."""
        out: dict[str, float | str] = {f"{prefix}/skipped_steps": float(self.skipped),
                                       f"{prefix}/step_skipped": float(self.reason is not None)}
        if self.reason is not None:
            out[f"{prefix}/skip_reason"] = self.reason
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row, "first": self.first}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped, self.in_a_row, self.first = int(state["skipped"]), int(state["in_a_row"]), state["first"]


@dataclass
class Trainer:
    """The model, its optimizer and schedule, and where the stage resumes from."""

    model: PreTrainedModel
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int  # optimizer steps already taken
    data_state: dict[str, Any] | None  # the stage's data position, as it saved it
    guard: NumericGuard = field(default_factory=NumericGuard)
    name: str = "stage"  # the stage's folder, for messages
    stage_dir: Path | None = None  # where its checkpoints go (None: a test's bare trainer)
    say: Callable[[str], None] = field(default=print, repr=False)  # the run's console
    sharded_checkpoints: bool = False  # distributed.strategy fsdp: step checkpoints through torch.distributed.checkpoint

    @property
    def sharded(self) -> bool:
        """The model's parameters are FSDP2 shards (fsdp on more than one rank)."""
        return is_sharded(self.model)


def start_or_resume(ctx: RunContext, cfg: TrainStage,
                    load: Callable[[Path, bool], PreTrainedModel] | None = None, *, heads: tuple[str, ...] = (),
                    data_parallel: bool = False, shardable: bool = False) -> Trainer:
    """Load the stage's start checkpoint — or its newest resumable one, restoring the whole state.

    data_parallel: the stage shards its batches over `ctx.ranks` and sums its gradients over them
    (docs/distributed.md); a stage that does not say so refuses to run on more than one rank, rather
    than train N unsynchronized copies. Every rank loads the same checkpoint.
    shardable: the stage runs with `distributed.strategy: fsdp` — the model is `fully_shard`ed over the
    ranks (`distributed.fsdp`) and its step checkpoints are sharded (`runtime.checkpoint`); a stage that
    does not say so refuses fsdp on more than one rank.

    Resume reads either checkpoint format at any world size: a sharded one (`shards/`) is loaded into
    the model built from the stage's start (then resharded by torch.distributed.checkpoint); a whole one
    (`model.safetensors` + the optimizer's state) is loaded before sharding, its optimizer state after.

    load(path, resuming): the model at `path` (default: `ctx.load_model`); a stage whose model is not
    a causal LM (the reward model's scalar head) passes its own.
    With `model.lora` in the recipe the start checkpoint's weights (merged, if it is itself a LoRA
    checkpoint) are the frozen base and the stage trains a fresh adapter on them — or, on resume, the
    saved one; `heads` (e.g. ("score",)) train in full beside it (docs/lora.md)."""
    if ctx.ranks.world_size > 1 and not data_parallel:
        raise DistributedError(f"{cfg.folder}: the {cfg.stage} stage does not run data-parallel yet "  # type: ignore[attr-defined]
                               f"({ctx.ranks.world_size} ranks); run it in one process")
    fsdp = ctx.recipe.distributed.strategy == "fsdp"
    spec = ctx.recipe.model.lora
    if fsdp and ctx.ranks.world_size > 1 and not shardable:
        raise DistributedError(f"{cfg.folder}: the {cfg.stage} stage does not run with distributed.strategy fsdp yet; "  # type: ignore[attr-defined]
                               f"use strategy: replicate")
    if fsdp and ctx.ranks.world_size > 1 and spec is not None:
        raise DistributedError(f"{cfg.folder}: distributed.strategy fsdp with model.lora is not supported (the adapters "
                               f"are small: use strategy: replicate)")
    resume_from = latest_checkpoint(ctx.stage_dir(cfg.folder))
    from_shards = resume_from is not None and is_sharded_checkpoint(resume_from)
    loader = load or (lambda path, _: ctx.load_model(path))
    if spec is None:  # a sharded checkpoint holds no HF weights: the start's architecture, its weights loaded below
        model = loader(ctx.start if from_shards else resume_from or ctx.start, resume_from is not None)
    else:
        base = loader(ctx.start, False)
        model = (lora.load_adapter(base, resume_from, trainable=True) if resume_from is not None else
                 lora.wrap(base, r=spec.r, alpha=spec.alpha, dropout=spec.dropout, target_modules=spec.target_modules,
                           heads=heads, base=ctx.start))
    model.train()
    if cfg.activation_checkpointing:  # per decoder layer, non-reentrant (works with frozen inputs, LoRA, custom attention)
        if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.x on
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ctx.console.print(describe_trainable(cfg.folder, model))
    if fsdp and shardable and ctx.ranks.world_size > 1:
        shard_model(model, ctx.ranks)  # in place: parameters become this rank's DTensor shards
        ctx.console.print(f"{cfg.folder}: FSDP2 over {ctx.ranks.world_size} ranks (each decoder layer and the root "
                          f"sharded; gradients reduce-scattered by sum once per step)")
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = warmup_cosine(optimizer, cfg.optim, cfg.steps)
    t = Trainer(model, optimizer, scheduler, step=0, data_state=None, guard=NumericGuard(cfg.optim.max_nonfinite_skips),
                name=cfg.folder, stage_dir=ctx.stage_dir(cfg.folder), say=ctx.console.print,
                sharded_checkpoints=fsdp and shardable and spec is None)  # LoRA: its adapter, as always
    if resume_from is None:
        return t
    state = load_state(resume_from)
    if from_shards:
        load_shards(model, optimizer, resume_from / SHARDS_DIR)  # every rank reads its pieces (a collective)
    else:
        load_whole_optimizer_state(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    if "guard" in state:
        t.guard.load_state_dict(state["guard"])
    ctx.console.print(f"[yellow]resuming {cfg.folder} from {resume_from.name} (step {state['step']})")
    t.step, t.data_state = int(state["step"]), state.get("data")
    return t


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
    """Publish the stage's checkpoint of step `t.step` (or its `final`). Data-parallel: the ranks' weights
    are checked equal first, rank 0 alone writes (every rank holds the same state), and every rank
    returns once it is published — the next stage's ranks all load `final`.

    Sharded (`distributed.strategy: fsdp`): a step checkpoint is written by every rank through
    torch.distributed.checkpoint (weights and AdamW state, each rank its shards), published by rank 0 with
    the manifest; the `final` is HF-format whole weights, gathered once (what the next stage and
    `posttrain eval` read), without optimizer state."""
    stage_dir = ctx.stage_dir(cfg.folder)
    state = {"stage": cfg.folder, "step": t.step, "scheduler": t.scheduler.state_dict(), "data": data_state,
             "guard": t.guard.state_dict()}
    if t.sharded_checkpoints and not final:
        return save_sharded_checkpoint(stage_dir, t.model, t.optimizer, ctx.tokenizer, state, ranks=ctx.ranks,
                                       keep_last=cfg.keep_last)
    if t.sharded:
        whole = full_state_dict(t.model, cpu=True)  # a collective: every rank gathers, rank 0 writes
        if ctx.ranks.is_main:
            save_checkpoint(stage_dir, t.model, ctx.tokenizer, {**state, "optimizer": None}, keep_last=cfg.keep_last,
                            final=final, weights=whole)
        ctx.ranks.barrier()  # a sync point: the checkpoint is published for every rank
        return stage_dir / checkpoint_name(t.step, final)
    check_replicas_agree(ctx.ranks, t.model, f"{cfg.folder} step {t.step}")
    path = stage_dir / checkpoint_name(t.step, final)
    if ctx.ranks.is_main:
        path = save_checkpoint(stage_dir, t.model, ctx.tokenizer, {**state, "optimizer": t.optimizer.state_dict()},
                               keep_last=cfg.keep_last, final=final)
    ctx.ranks.barrier()  # a sync point: the checkpoint is published for every rank
    return path


def micro_batch_count(grad_accum: int, world_size: int) -> int:
    """Micro-batches per optimizer step over all ranks: `grad_accum`, rounded up to a multiple of the world
    size so that every rank runs as many (one process: `grad_accum`)."""
    return world_size * math.ceil(grad_accum / world_size)


def batch_split_problem(cfg: TrainStage, world_size: int, what: str = "items") -> str | None:
    """Why `cfg.batch_size` cannot be cut into `micro_batch_count` equal micro-batches dealt over
    `world_size` ranks (None: it can)."""
    m = micro_batch_count(cfg.grad_accum, world_size)
    if cfg.batch_size % m:
        return (f"{cfg.folder}: batch_size {cfg.batch_size} ({what}) does not split into {m} micro-batches "  # type: ignore[attr-defined]
                f"({world_size} ranks × {m // world_size}); make it a multiple of {m}")
    return None


def reduce_gradients(t: Trainer, ranks: World) -> None:
    """After the step's last backward: replicated, sum the gradients over the ranks (a sync point);
    sharded, nothing — FSDP reduce-scattered them in that backward."""
    if not t.sharded:
        all_reduce_gradients(ranks, t.model)


def rollout_policy(ctx: RunContext, t: Trainer) -> torch.nn.Module:
    """The module a rollout engine samples from (and rank 0's in-stage evals read): the policy itself; with
    sharded weights, an unsharded frozen copy — the start's architecture with the policy's current
    weights, gathered here (a collective) and reloaded at every `sync` (`policy_weights`)."""
    if not t.sharded:
        return t.model
    copy = ctx.load_model(ctx.start).requires_grad_(False)
    copy.load_state_dict(full_state_dict(t.model))  # a resumed policy is not the start: its weights now
    return copy


def policy_weights(t: Trainer) -> torch.nn.Module | dict[str, torch.Tensor]:
    """What `RolloutEngine.sync_weights` loads after an update: the policy module (the engine shares it:
    nothing moves), or with sharded weights the whole weights, all-gathered on every rank (a collective;
    its cost is the `sync` phase's)."""
    return full_state_dict(t.model) if t.sharded else t.model


def micro_batch_sync(t: Trainer, index: int, count: int) -> None:
    """Before micro-batch `index` of the `count` this rank runs in a step: FSDP reduce-scatters only the
    last one's backward (`distributed.fsdp.gradient_sync`); no-op when replicated."""
    gradient_sync(t.model, index == count - 1)


def idle_micro_batches(t: Trainer, done: int, count: int, device: torch.device) -> None:
    """FSDP: a rank that ran `done` of the step's `count` micro-batches (every rank runs `count` forwards
    and backwards, each an all-gather) runs the rest with a zero loss. No-op when replicated."""
    if not t.sharded:
        return
    for i in range(done, count):
        micro_batch_sync(t, i, count)
        idle_backward(t.model, device)


def optimizer_step(t: Trainer, cfg: OptimConfig, losses: dict[str, float] | None = None) -> float:
    """One guarded update (`guarded_update`), then the schedule and the step count. Returns the pre-clip
    gradient norm (a device sync point). A skipped update still moves the step count and the schedule on
    (the lr follows the step number)."""
    t.guard.begin_step()
    norm = guarded_update(t, cfg, losses or {}, step=t.step + 1)
    next_step(t)
    return norm


def next_step(t: Trainer) -> None:
    """The schedule and the step count move on, whether or not this step's updates were taken."""
    with warnings.catch_warnings():  # a skipped update is meant: the schedule follows the step count
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        t.scheduler.step()
    t.step += 1


def guarded_update(t: Trainer, cfg: OptimConfig, losses: dict[str, float], *, step: int, where: str = "") -> float:
    """Guard, clip, step the optimizer, zero the gradients — one update of `t.model`, without the schedule.

    The guard: when a value of `losses` (this update's loss terms, by metric name) or the gradient norm
    is NaN or ±inf, the update is skipped — the gradients are dropped, parameters and AdamW moments stay
    as they were; `t.guard` counts it and keeps the reason (`step`, and `where` within it), the console
    gets one line, and `cfg.max_nonfinite_skips` skips in a row raise NonFiniteError. The clip is
    `clip_grad_norm_`'s — gradients × min(1, limit / (norm + 1e-6)) — except that a factor of exactly 1
    (every norm up to ~1e-6 below the limit) skips the multiply, a pass over all gradients that would
    leave them bitwise as they are; where the step runs our AdamW kernel (stages/_adamw.py) the multiply is
    inside the step's one pass, the same products. Returns the pre-clip gradient norm (a device sync point)."""
    params = [p for p in t.model.parameters() if p.grad is not None]
    grad_norm = gradient_norm([p.grad for p in params])  # sharded: reduced over the ranks (a sync point)
    norm = float(grad_norm)                                                # device sync point
    reason = t.guard.check(step, losses, norm, where)
    t.guard.record(reason)
    if reason is None:
        coef = cfg.grad_clip / (grad_norm + 1e-6)                          # as torch computes it
        if isinstance(t.optimizer, AdamW) and t.optimizer.kernel_ready():  # the clip's multiply in the step's pass
            t.optimizer.step(coef=float(torch.clamp(coef, max=1.0)))
        else:
            if not bool(coef >= 1.0):
                torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, grad_norm)  # scales each p.grad
            t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    if reason is not None:
        g = t.guard
        t.say(f"[bold yellow]{t.name}: optimizer step {step} skipped: {reason} is not finite "
              f"({g.in_a_row} in a row, {g.skipped} in this stage; the stage stops at {g.limit} in a row)")
        if g.in_a_row >= g.limit:
            kept = latest_checkpoint(t.stage_dir) if t.stage_dir is not None else None
            where_kept = (f"{kept} is the newest checkpoint kept" if kept else
                          "no checkpoint of this stage was written; it restarts from its start on --resume")
            raise NonFiniteError(f"{t.name}: stopped after {g.in_a_row} optimizer steps in a row with non-finite values; "
                                 f"first: {g.first}; {where_kept}")
    return norm
