"""Bytes a weight sync moves, full vs delta (posttrain/distributed/weight_sync.py), after real AdamW steps.

    python benchmarks/placement_sync.py                                  # tiny-1m and tiny-30m, full FT and LoRA, fp32 and bf16 wire
    python benchmarks/placement_sync.py --models tiny-1m --lr 1e-5 --steps 3

For each model (random init, vocabulary 512), with and without LoRA (r 16 on every projection), and each
wire dtype (fp32: an fp32-sampling engine; bf16: a bf16-sampling one), it takes `--steps` AdamW steps of a
next-token loss on random tokens (4 × 64; what changes is set by AdamW, which moves every element with a
gradient history by about lr, not by the data) and after each one plans a delta sync against the last
and a full one: mean bytes per sync, the delta's share of the full send, and the planning time on the
learner (fingerprints, element compares, casts). No Ray: what the workers would receive.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.distributed.weight_sync import SyncMode, SyncState, named_tensors, plan_sync, to_wire
from posttrain.models import build_tiny, lora


def measure(model_name: str, use_lora: bool, wire: torch.dtype, lr: float, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = build_tiny(model_name, vocab_size=512, seed=0)
    if use_lora:
        model = lora.wrap(model, r=16, alpha=32, dropout=0.0,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    state = SyncState(SyncMode.DELTA)
    plan_sync(state, to_wire(named_tensors(model), wire))  # the workers' start
    delta, full, seconds = [], [], []
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, 512, (4, 64), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        t0 = time.perf_counter()
        p = plan_sync(state, to_wire(named_tensors(model), wire))
        seconds.append(time.perf_counter() - t0)
        delta.append(p.nbytes)
        full.append(p.full_bytes)
    return {"delta": statistics.mean(delta), "full": statistics.mean(full), "seconds": statistics.median(seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-1m", "tiny-30m"])
    ap.add_argument("--lr", type=float, default=7e-5, help="AdamW lr (recipes/rlvr-arithmetic.yaml's GRPO lr)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"lr {args.lr:g}, {args.steps} AdamW steps; bytes per sync (mean over the steps)\n")
    print(f"| model | weights | wire | full send | delta | delta / full | plan time |")
    print(f"|---|---|---|---:|---:|---:|---:|")
    for name in args.models:
        for use_lora in (False, True):
            for wire_name, wire in (("fp32", None), ("bf16", torch.bfloat16)):
                m = measure(name, use_lora, wire, args.lr, args.steps)
                print(f"| {name} | {'LoRA r16' if use_lora else 'full FT'} | {wire_name} | {m['full']:,.0f} | {m['delta']:,.0f} "
                      f"| {m['delta'] / m['full']:.1%} | {m['seconds'] * 1e3:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
