"""Supervised fine-tuning on demonstrations: token cross-entropy on response tokens only.

The loss is normalized by the response tokens of the whole optimizer step (not per micro-batch), so
`grad_accum` changes memory, never the gradient (posttrain.losses.sft). The data position (epoch,
batch within it) is part of every checkpoint, so resume continues on exactly the next batch.

Data-parallel (docs/distributed.md): every rank draws the same global batch, sorts it by length and
splits it into the same micro-batches, and runs the ones dealt to it (r, r + W, …); the loss is still
over the whole step's response tokens, and the gradients are summed over the ranks — the step one
process takes, up to float round-off.
"""

from __future__ import annotations

import math
import time

import torch

from posttrain.data import EncodedSFT, EpochSampler, collate_sft, encode_sft_dataset, mix, read_jsonl
from posttrain.data.records import SFTExample
from posttrain.distributed import DistributedError, deal
from posttrain.losses import sft_loss, token_logprobs
from posttrain.runtime.config import DataSource, SFTStage, task_names
from posttrain.runtime.context import RunContext, StageResult
from posttrain.stages._packing import SFT_BUCKET, token_bucket
from posttrain.stages._training import micro_batch_sync, optimizer_step, reduce_gradients, save, start_or_resume
from posttrain.tasks import Capability
from posttrain.telemetry import costs


def load_sft_examples(ctx: RunContext, sources: list[DataSource], *, seed_offset: int = 0) -> list[SFTExample]:
    """The stage's examples: each source read (and validated) whole, then mixed by weight."""
    pools: list[tuple[list[SFTExample], float]] = []
    for src in sources:
        if src.path is not None:
            pools.append((read_jsonl(src.path, "sft").records, src.weight))
        else:
            pools.append((ctx.tasks.get(src.task).records("sft", src.n, seed_offset=seed_offset), src.weight))
    total = sum(len(p) for p, _ in pools)
    return pools[0][0] if len(pools) == 1 else mix(pools, total, seed=ctx.recipe.seed)


def heldout_examples(ctx: RunContext, cfg: SFTStage) -> list[SFTExample]:
    """`heldout` fresh examples of the first data task with demonstrations (never a training one: a
    different seed offset), for the eval loss; none, said so, when the sources are files only."""
    if not cfg.heldout:
        return []
    task = ctx.tasks.first_with(task_names(cfg.data), Capability.SFT)
    if task is None:
        ctx.console.print(f"[dim]{cfg.folder}: no held-out eval loss (heldout: {cfg.heldout}, but no data source is a task "
                          "that supplies demonstrations; a file's examples are all trained on)")
        return []
    return load_sft_examples(ctx, [DataSource(task=task.name, n=cfg.heldout)], seed_offset=1)


def sft_batch_loss(model, encoded: list[EncodedSFT], pad_id: int, num_tokens: float) -> tuple[torch.Tensor, int]:
    """Response-token NLL of a micro-batch over the step's token count. Returns (loss, tokens). Where the
    matmuls are bf16 on a CPU, T is padded up to a multiple of `SFT_BUCKET` (`_packing.TOKEN_BUCKET`: oneDNN
    builds a kernel per shape)."""
    bucket = SFT_BUCKET if token_bucket(next(model.parameters()).device) > 1 else 1
    longest = max((len(e.input_ids) for e in encoded), default=0)
    b = collate_sft(encoded, pad_id, pad_to=-(-longest // bucket) * bucket)  # (B, T) each
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).logits[:, :-1]  # (B, T-1, V)
    targets = b.labels[:, 1:]
    mask = (targets != -100).to(logits.dtype)
    logps = token_logprobs(logits, targets.clamp_min(0))  # (B, T-1)
    loss, stats = sft_loss(logps, mask, num_tokens=num_tokens)
    return loss, int(stats.num_tokens)


@torch.no_grad()
def heldout_loss(model, encoded: list[EncodedSFT], pad_id: int, batch: int = 64) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(encoded), batch):
        loss, n = sft_batch_loss(model, encoded[i : i + batch], pad_id, num_tokens=1)
        total, count = total + float(loss), count + n
    model.train()
    return total / max(1, count)


def micro_batches(cfg: SFTStage, world_size: int) -> int:
    """Micro-batches per optimizer step over all ranks: `grad_accum`, rounded up to a multiple of the
    world size so that every rank runs as many."""
    return world_size * math.ceil(cfg.grad_accum / world_size)


def data_parallel_problem(cfg: SFTStage, world_size: int) -> str | None:
    """Why this stage cannot run on `world_size` ranks, or None."""
    m = micro_batches(cfg, world_size)
    if cfg.batch_size % m:
        return (f"{cfg.folder}: batch_size {cfg.batch_size} does not split into {m} micro-batches "
                f"({world_size} ranks × {m // world_size}); make it a multiple of {m}")
    return None


def run_sft(cfg: SFTStage, ctx: RunContext) -> StageResult:
    # ---- setup ---------------------------------------------------------------------------------
    if problem := data_parallel_problem(cfg, ctx.ranks.world_size):
        raise DistributedError(problem)
    tok = ctx.tokenizer
    truncation = "error" if cfg.truncation == "error" else "right"
    train, n_trunc = encode_sft_dataset(load_sft_examples(ctx, cfg.data), tok, cfg.max_len, truncation=truncation)
    if n_trunc:
        train = [e for e in train if not e.truncated]  # "drop": over-long examples are counted and left out
        ctx.console.print(f"[yellow]{cfg.folder}: dropped {n_trunc} examples longer than max_len={cfg.max_len}")
    val, _ = encode_sft_dataset(heldout_examples(ctx, cfg), tok, cfg.max_len, truncation="right")
    t = start_or_resume(ctx, cfg, data_parallel=True, shardable=True)
    sampler = EpochSampler(len(train), cfg.batch_size, seed=ctx.recipe.seed)
    if t.data_state is not None:
        sampler.load_state_dict(t.data_state)
    ranks, n_micro = ctx.ranks, micro_batches(cfg, ctx.ranks.world_size)
    micro = cfg.batch_size // n_micro
    mean_len = sum(len(e.input_ids) for e in train) / len(train)
    ctx.console.print(
        f"{cfg.folder}: {len(train):,} examples (mean {mean_len:.0f} tokens); {cfg.batch_size} sequences "
        f"(≈{cfg.batch_size * mean_len:,.0f} tokens) per optimizer step in {n_micro} micro-batches"
        + (f" ({ranks.world_size} ranks × {n_micro // ranks.world_size} of {micro} sequences)" if ranks.world_size > 1 else "")
        + f"; {sampler.batches_per_epoch} steps per epoch; {cfg.steps} steps = {cfg.steps / sampler.batches_per_epoch:.2f} epochs"
    )

    # ---- loop ----------------------------------------------------------------------------------
    with ctx.progress() as bar:
        task = bar.add_task(cfg.folder, total=cfg.steps, completed=t.step, info="")
        while t.step < cfg.steps:
            step = t.step + 1
            t0 = time.perf_counter()
            # Length-grouped micro-batches: sorting the step's examples by length before splitting them
            # pads each micro-batch to its own longest row (≈ half the padded tokens of one big batch on
            # the demo's data). The loss is normalized by the whole step's tokens, so it is unchanged.
            batch = sorted((train[i] for i in sampler.next_batch()), key=lambda e: len(e.input_ids))
            num_tokens = sum(sum(1 for y in e.labels[1:] if y != -100) for e in batch)  # whole step's response tokens
            chunks = [batch[i : i + micro] for i in range(0, len(batch), micro)]
            padded = sum(len(c) * len(c[-1].input_ids) for c in chunks)  # tokens the forward passes really run
            mine = deal(chunks, ranks)  # this rank's micro-batches (all of them in one process)
            step_cost = sum((costs.train_step(t.model.config, batch=len(c), seq_len=len(c[-1].input_ids), optimizer=False)
                             for c in mine), costs.adamw(t.model.config))
            with ctx.phase("update", stage=cfg.folder, step=step, cost=step_cost):
                total = 0.0
                for i, chunk in enumerate(mine):
                    micro_batch_sync(t, i, len(mine))  # FSDP: reduce-scatter after the last backward only
                    with ctx.autocast():
                        loss, _ = sft_batch_loss(t.model, chunk, tok.pad_token_id, num_tokens)
                    loss.backward()
                    total += loss.item()
                reduce_gradients(t, ranks)  # the step's gradient: every rank's micro-batches (a sync point)
                total = ranks.sum({"loss/sft": total})["loss/sft"]  # the step's loss, for the guard and the log
                grad_norm = optimizer_step(t, cfg.optim, {"loss/sft": total})
            metrics = {"loss/sft": total, "train/grad_norm": grad_norm, "train/lr": t.scheduler.get_last_lr()[0],
                       "train/tokens_per_s": padded / (time.perf_counter() - t0),
                       "train/epoch": sampler.epoch + sampler.position / sampler.batches_per_epoch, **t.guard.metrics()}
            evaluates = bool(val) and bool(cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps)
            # sharded weights: every rank runs the eval's forwards (each all-gathers); rank 0 logs it
            if evaluates and (ranks.is_main or t.sharded):
                with ctx.phase("eval", stage=cfg.folder, step=step):
                    metrics["eval/loss"] = heldout_loss(t.model, val, tok.pad_token_id)
            if step % cfg.log_every == 0 or evaluates:  # the same steps on every rank: ctx.log is a collective
                ctx.log(cfg.folder, step, metrics)
            bar.update(task, completed=step, info=f"loss {total:.3f}  {metrics['train/tokens_per_s']:,.0f} tok/s")
            if step % cfg.save_every == 0 and step < cfg.steps:
                save(ctx, cfg, t, data_state=sampler.state_dict())

    # ---- save ----------------------------------------------------------------------------------
    final = save(ctx, cfg, t, data_state=sampler.state_dict(), final=True)
    return StageResult(final, {k: v for k, v in metrics.items() if k.startswith(("loss/", "eval/"))})
