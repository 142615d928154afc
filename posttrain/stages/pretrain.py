"""Pretraining: next-token prediction over a task's packed document stream (the arithmetic world's).

Gives the tiny base its knowledge (facts in prose, worked columns) without the behaviour of answering
a chat question: that is what SFT adds. Batches are a pure function of (seed, step) over a fixed packed
stream, so resume needs no data position.
"""

from __future__ import annotations

import time

import torch

from posttrain.data import pack_documents
from posttrain.losses import sft_loss, token_logprobs
from posttrain.models.tokenizer import EOS
from posttrain.runtime.config import PretrainStage
from posttrain.runtime.context import RunContext, StageResult
from posttrain.stages._training import optimizer_step, save, start_or_resume
from posttrain.telemetry import costs


def packed_stream(ctx: RunContext, cfg: PretrainStage, *, heldout: bool = False):
    """(N, seq_len) rows of the task's documents (`cfg.task`), EOS-separated. Shape: (rows, seq_len)."""
    n = max(64, cfg.documents // 50) if heldout else cfg.documents
    docs = list(ctx.tasks.get(cfg.task).pretrain_documents(n, seed_offset=1 if heldout else 0))
    ids = ctx.tokenizer(docs, add_special_tokens=False)["input_ids"]
    return pack_documents(ids, cfg.seq_len, eos_id=ctx.tokenizer.convert_tokens_to_ids(EOS))


def lm_loss(model, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL of `rows` and the number of predicted tokens."""
    logits = model(input_ids=rows, use_cache=False).logits[:, :-1]  # (B, T-1, V)
    logps = token_logprobs(logits, rows[:, 1:])  # (B, T-1)
    loss, stats = sft_loss(logps, torch.ones_like(logps), num_tokens=1)
    return loss, int(stats.num_tokens)


@torch.no_grad()
def heldout_loss(model, rows: torch.Tensor, batch: int = 64) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, rows.shape[0], batch):
        loss, n = lm_loss(model, rows[i : i + batch])
        total, count = total + float(loss), count + n
    model.train()
    return total / count


def run_pretrain(cfg: PretrainStage, ctx: RunContext) -> StageResult:
    # ---- setup ---------------------------------------------------------------------------------
    rows, val_rows = packed_stream(ctx, cfg), packed_stream(ctx, cfg, heldout=True)
    t = start_or_resume(ctx, cfg)
    micro = cfg.batch_size // cfg.grad_accum
    tokens_per_step = cfg.batch_size * (cfg.seq_len - 1)
    ctx.console.print(
        f"{cfg.folder}: {rows.shape[0]:,} packed rows × {cfg.seq_len} tokens; {tokens_per_step:,} tokens per optimizer step; "
        f"{cfg.steps} steps = {cfg.steps * cfg.batch_size / rows.shape[0]:.2f} epochs"
    )
    step_cost = costs.train_step(t.model.config, batch=cfg.batch_size, seq_len=cfg.seq_len)

    # ---- loop ----------------------------------------------------------------------------------
    with ctx.progress() as bar:
        task = bar.add_task(cfg.folder, total=cfg.steps, completed=t.step, info="")
        while t.step < cfg.steps:
            step = t.step + 1
            t0 = time.perf_counter()
            gen = torch.Generator().manual_seed(ctx.recipe.seed * 1_000_003 + step)
            batch = rows[torch.randint(0, rows.shape[0], (cfg.batch_size,), generator=gen)]  # (B, T)
            with ctx.phase("update", stage=cfg.folder, step=step, cost=step_cost):
                total = 0.0
                for chunk in batch.split(micro):
                    with ctx.autocast():
                        loss, n = lm_loss(t.model, chunk)
                    (loss / tokens_per_step).backward()  # normalizer = tokens of the whole step
                    total += loss.item()
                grad_norm = optimizer_step(t, cfg.optim, {"loss/lm": total / tokens_per_step})
            metrics = {"loss/lm": total / tokens_per_step, "train/grad_norm": grad_norm,
                       "train/lr": t.scheduler.get_last_lr()[0],
                       "train/tokens_per_s": tokens_per_step / (time.perf_counter() - t0), **t.guard.metrics()}
            if cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps:
                with ctx.phase("eval", stage=cfg.folder, step=step):
                    metrics["eval/loss"] = heldout_loss(t.model, val_rows)
            if step % cfg.log_every == 0 or "eval/loss" in metrics:
                ctx.log(cfg.folder, step, metrics)
            bar.update(task, completed=step, info=f"loss {metrics['loss/lm']:.3f}  {metrics['train/tokens_per_s']:,.0f} tok/s")
            if step % cfg.save_every == 0 and step < cfg.steps:
                save(ctx, cfg, t, data_state=None)

    # ---- save ----------------------------------------------------------------------------------
    final = save(ctx, cfg, t, data_state=None, final=True)
    return StageResult(final, {"loss/lm": metrics["loss/lm"], "eval/loss": metrics["eval/loss"]})
