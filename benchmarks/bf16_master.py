"""What bf16 master weights would cost in accuracy: the same training with fp32 weights under bf16 autocast
(what `dtype: bf16` recipes do), with the weights and AdamW's state in bf16 themselves, and in fp32.

    python benchmarks/bf16_master.py --threads 1
    python benchmarks/bf16_master.py --model tiny-4m --pretrain-steps 300 --finetune-steps 150

Two regimes, each arm from the same initial weights on the same batches (the arithmetic world's text):
- **pretraining** from random weights at the quickstart's pretraining rate (3e-3, warm-up 30, cosine to 0.1×);
- **fine-tuning** from the fp32-master arm's pretrained weights at the quickstart's DPO rate (3e-5) on its
  SFT conversations (language-model loss over the whole text) — where an update is small against its weight.

For each arm: the held-out loss along the way (fp32 evaluation of the arm's own weights), the median seconds a
step, and for the bf16 arm the share of weight elements an optimizer step leaves unchanged (the update rounded away: a bf16 weight of magnitude 1 cannot move by less
than 2⁻⁸). Writes `runs/bench/bf16_master/bf16_master.{md,json}`. Benchmarks only: no recipe offers bf16
master weights (docs/performance.md, "Precision").
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from posttrain.models import build_tiny, train_tokenizer
from posttrain.worlds.arithmetic import ArithmeticWorld

ARMS = ("fp32 master, bf16 autocast", "bf16 weights and optimizer", "fp32")


def _batches(tok, texts: list[str], batch: int, seq: int, steps: int, seed: int) -> list[torch.Tensor]:
    """`steps` batches of `batch` rows of `seq` tokens, the texts concatenated (EOS between) and cut."""
    ids: list[int] = []
    for t in texts:
        ids += tok(t)["input_ids"] + [tok.eos_token_id]
    flat = torch.tensor(ids)
    windows = flat[: len(flat) // seq * seq].view(-1, seq)
    g = torch.Generator().manual_seed(seed)
    return [windows[torch.randint(0, len(windows), (batch,), generator=g)] for _ in range(steps)]


def _lr(step: int, steps: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def _eval_loss(model, batches: list[torch.Tensor]) -> float:
    """Mean next-token loss with the weights as they are, computed in fp32."""
    dtype = next(model.parameters()).dtype
    model.float()
    loss = sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)
    model.to(dtype)
    return loss


def train(arm: str, model, batches, held_out, *, peak_lr: float, warmup: int, floor: float, every: int) -> dict:
    """Train `model` (in place) on `batches`; returns the curve, the seconds a step and, for the bf16 arm,
    the share of weight elements each step left unchanged."""
    if arm == ARMS[1]:
        model.to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=peak_lr, weight_decay=0.0, foreach=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=arm == ARMS[0])
    curve, unchanged, seconds = [(0, _eval_loss(model, held_out))], [], []
    for step, b in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = _lr(step, len(batches), peak_lr, warmup, floor)
        t0 = time.perf_counter()
        with autocast:
            loss = model(input_ids=b, labels=b).loss
        loss.backward()
        before = [p.detach().clone() for p in params] if arm == ARMS[1] else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        if before is not None:
            same = sum(int((p.detach() == q).sum()) for p, q in zip(params, before))
            unchanged.append(same / sum(p.numel() for p in params))
        if (step + 1) % every == 0 or step + 1 == len(batches):
            curve.append((step + 1, _eval_loss(model, held_out)))
    model.float()
    seconds = sorted(seconds[1:]) or seconds
    return {"curve": curve, "s_per_step": seconds[len(seconds) // 2], "unchanged": unchanged}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-4m")
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--finetune-steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/bf16_master"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    world = ArithmeticWorld(seed=0)
    docs = list(world.pretrain_documents(4000))
    chats = [f"user\n{ex[0]['content']}\nassistant\n{ex[1]['content']}" for ex in world.sft_split(3000)]
    tok = train_tokenizer(docs[:2000] + chats[:1000], vocab_size=512)
    pre, pre_held = (_batches(tok, docs[:3500], a.batch, a.seq, a.pretrain_steps, 1),
                     _batches(tok, docs[3500:], a.batch, a.seq, 8, 2))
    fine, fine_held = (_batches(tok, chats[:2500], a.batch, a.seq, a.finetune_steps, 3),
                       _batches(tok, chats[2500:], a.batch, a.seq, 8, 4))
    init = build_tiny(a.model, vocab_size=len(tok), seed=0, max_seq_len=a.seq, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
    state = {k: v.clone() for k, v in init.state_dict().items()}
    results: dict[str, dict] = {}
    pretrained = None
    for regime, batches, held, lr, warmup, floor in (("pretraining", pre, pre_held, 3e-3, 30, 0.1),
                                                     ("fine-tuning", fine, fine_held, 3e-5, 10, 0.1)):
        for arm in ARMS:
            model = build_tiny(a.model, vocab_size=len(tok), seed=0, max_seq_len=a.seq,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            model.load_state_dict(state if regime == "pretraining" else pretrained)
            model.train()
            r = train(arm, model, batches, held, peak_lr=lr, warmup=warmup, floor=floor,
                      every=max(1, len(batches) // 6))
            results[f"{regime} | {arm}"] = r
            if regime == "pretraining" and arm == ARMS[0]:
                pretrained = {k: v.clone() for k, v in model.state_dict().items()}
            print(f"{regime:12s} {arm:28s} held-out loss {r['curve'][0][1]:.4f} → {r['curve'][-1][1]:.4f}  "
                  f"{r['s_per_step'] * 1e3:.1f} ms/step"
                  + (f"  unchanged by a step: {100 * sum(r['unchanged']) / len(r['unchanged']):.1f}%"
                     if r["unchanged"] else ""), flush=True)
    lines = [f"# bf16 master weights: {a.model}, {a.batch} × {a.seq} tokens a step, {a.threads} thread(s)", "",
             "| regime | arm | held-out loss, start → end | along the way | ms / step (median) | weights a step leaves unchanged |",
             "|---|---|---|---|---|---|"]
    for key, r in results.items():
        regime, arm = key.split(" | ")
        along = ", ".join(f"{s}: {v:.3f}" for s, v in r["curve"][1:-1])
        share = f"{100 * sum(r['unchanged']) / len(r['unchanged']):.1f}%" if r["unchanged"] else "—"
        lines.append(f"| {regime} | {arm} | {r['curve'][0][1]:.4f} → **{r['curve'][-1][1]:.4f}** | {along} | "
                     f"{r['s_per_step'] * 1e3:.1f} | {share} |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bf16_master.md").write_text("\n".join(lines) + "\n")
    (a.out / "bf16_master.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
