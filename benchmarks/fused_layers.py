"""The fused RMSNorm, gated MLP and rotary embedding of the bf16 training forward, each switched on and off in one process:
seconds of a forward + backward and the bytes autograd keeps for the backward.

tiny-30m (`_vs_trl_grpo.prepare`, random init), DPO's shape: 8 pairs of `L`-token sequences (a quarter
prompt), one packed row through `stages._packing.pair_logps` and the shared-prefix kernel, bf16 autocast
over fp32 weights, exactly as the `dpo` stage runs its policy forward. The arms — neither fused, the
norm fused (`models/fused_norm.py`), the norm and the MLP (`models/fused_mlp.py`), those and the attention's
rotary embedding (`models/fused_attention.py`; `norm+mlp+rope` is what `load_model` installs), and the last two
with every C kernel's part in PyTorch's ops instead (`-torch`: `native/rmsnorm.py`, `native/swiglu.py`,
`native/rope.py`) — switched by the modules' classes on one model, their order rotating from repetition to
repetition.
Times: the median of `--reps` calls (CPU seconds). Saved: the bytes of every tensor autograd keeps for the
backward (`torch.autograd.graph.saved_tensors_hooks`), which is what the step's activation memory is made of.

    python benchmarks/fused_layers.py --threads 1 --reps 5
    python benchmarks/fused_layers.py --threads 1 --reps 9 --lengths 64 256 --arms norm+mlp norm+mlp-torch
    python benchmarks/fused_layers.py --threads 1 --reps 7 --lengths 64 256 1024 --arms norm+mlp norm+mlp+rope
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from posttrain.data.encoding import EncodedCompletion
from posttrain.models import fused_attention, fused_mlp, fused_norm, load_model
from posttrain.native import rmsnorm, rope, swiglu
from posttrain.stages._packing import pair_logps

sys.path.insert(0, str(Path(__file__).parent))
import _vs_trl_grpo as grpo_sides  # noqa: E402

ARMS = ("neither", "norm", "norm+mlp", "norm+mlp+rope", "norm+mlp-torch", "norm+mlp+rope-torch")
_USABLE = swiglu.usable, rmsnorm.usable, rope.usable


def pairs_of(length: int, n: int = 8, vocab: int = 436, seed: int = 0) -> list[tuple[EncodedCompletion, EncodedCompletion]]:
    rng = random.Random(seed)
    p = length // 4
    r = length - p

    def encoded(prompt: list[int]) -> EncodedCompletion:
        reply = [rng.randrange(4, vocab) for _ in range(r)]
        return EncodedCompletion(prompt + reply, [-100] * p + reply, p)

    out = []
    for _ in range(n):
        prompt = [rng.randrange(4, vocab) for _ in range(p)]
        out.append((encoded(prompt), encoded(prompt)))
    return out


class Arms:
    """Switch a model's fused modules between their fused and their own classes."""

    def __init__(self, model: torch.nn.Module):
        self.norms = [m for m in model.modules() if fused_norm.is_fused(m)]
        self.mlps = [m for m in model.modules() if fused_mlp.is_fused(m)]
        self.attentions = [m for m in model.modules() if fused_attention.is_fused(m)]
        self.classes = {id(m): (type(m), type(m).__mro__[1]) for m in self.norms + self.mlps + self.attentions}

    def set(self, arm: str) -> None:
        swiglu.usable, rmsnorm.usable, rope.usable = ((lambda *a: None),) * 3 if arm.endswith("-torch") else _USABLE
        for modules, on in ((self.norms, arm != "neither"), (self.mlps, arm.startswith("norm+mlp")),
                            (self.attentions, "+rope" in arm)):
            for m in modules:
                fused, own = self.classes[id(m)]
                m.__class__ = fused if on else own


def forward_backward(model, pairs) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = pair_logps(model, pairs, 0, length_normalized=False)
    (a - b).sum().backward()
    return time.process_time() - t0


def saved_mib(model, pairs) -> float:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        pair_logps(model, pairs, 0, length_normalized=False)
    return total / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    args = ap.parse_args()
    chosen = tuple(args.arms)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        model_dir, _ = grpo_sides.prepare(Path(folder), max_seq_len=1280)
        model = load_model(model_dir, autocast_dtype=torch.bfloat16).train()
    arms = Arms(model)
    print(f"tiny-30m, 8 DPO pairs per call, bf16 autocast, {args.threads} thread(s); {len(arms.norms)} norms, "
          f"{len(arms.mlps)} MLPs, {len(arms.attentions)} attentions fused\n")
    print("| pair length | tokens | arm | fwd + bwd s (median) | all reps | saved for backward, MiB |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        pairs = pairs_of(length)
        tokens = sum(len(a.input_ids) + len(b.input_ids) - a.prompt_len for a, b in pairs)
        saved, times = {}, {a: [] for a in chosen}
        for arm in chosen:
            arms.set(arm)
            saved[arm] = saved_mib(model, pairs)
            forward_backward(model, pairs)  # warm the heap and the kernels' caches for this shape
        for rep in range(args.reps):
            order = chosen[rep % len(chosen):] + chosen[:rep % len(chosen)]
            for arm in order:
                arms.set(arm)
                times[arm].append(forward_backward(model, pairs))
        for arm in chosen:
            t = times[arm]
            print(f"| {length} | {tokens} | {arm} | {statistics.median(t):.3f} | {', '.join(f'{x:.2f}' for x in t)} "
                  f"| {saved[arm]:.0f} |", flush=True)
        arms.set("norm+mlp+rope")


if __name__ == "__main__":
    main()
