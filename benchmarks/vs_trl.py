"""posttrain against TRL, side by side in one process: one section per comparison.

    python benchmarks/vs_trl.py                    # every section
    python benchmarks/vs_trl.py --only dpo         # DPO: seconds per optimizer step vs TRL DPOTrainer
    python benchmarks/vs_trl.py --only dpo --threads 2 --steps 12 --reps 2
    python benchmarks/vs_trl.py --only grpo        # GRPO: benchmarks/_vs_trl_grpo.py

TRL is a benchmark-only dependency (`pip install "trl>=1,<2"`), never imported by the library.

DPO section. Same tiny-30m model (same initial weights), same tokenizer, same world pairs, batch of
8 pairs per optimizer step, sigmoid DPO loss with β = 0.1, AdamW, fp32 on both sides unless
`--dtype bf16` (then both train under bf16 autocast). The settings TRL would otherwise pick on a CPU
are overridden and printed: `bf16=True` (its default whenever fp16 is off) and
`gradient_checkpointing=True` — a third row runs TRL with those defaults, to show what an out-of-the-box
run costs. Reference log-probs: posttrain caches them in a one-time `reference` phase before the loop
(its default); TRL's default recomputes them every step; a TRL row with `precompute_ref_log_probs=True`
shows TRL caching too. One-time costs (reference precompute, dataset tokenization) are reported apart
from the per-step time.

Seconds per step = the median gap between consecutive step ends after `--warmup` steps, which
includes batch collation and the optimizer on both sides, as process CPU time (robust when other
jobs share the cores, with one thread) and as wall time. Sides alternate within each repetition so
load from other processes hits both alike; the ratios are the numbers to read.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from posttrain.models import build_tiny, count_parameters, train_tokenizer
from posttrain.worlds.arithmetic import ArithmeticWorld


def world_tokenizer(world: ArithmeticWorld):
    texts = list(world.pretrain_documents(2000, seed_offset=99))
    texts += [f"user\n{ex[0]['content']}\nassistant\n{ex[1]['content']}" for ex in world.sft_split(1000, seed_offset=99)]
    return train_tokenizer(texts, vocab_size=512)


def now() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): CPU time barely moves when other jobs take the cores."""
    return time.perf_counter(), time.process_time()


def median_gap(ends: list[tuple[float, float]], warmup: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds between consecutive step ends, after `warmup` gaps."""
    gaps = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(ends)][warmup:]
    return statistics.median(g[0] for g in gaps), statistics.median(g[1] for g in gaps)


# ==== DPO ===========================================================================================


def ours_dpo(policy_dir: Path, tok, world, *, pairs: int, steps: int, dtype: str, threads: int) -> tuple[list[tuple[float, float]], float]:
    """posttrain's dpo stage as the pipeline runs it; returns (step end times, one-time reference seconds)."""
    from posttrain.runtime.config import DPOStage, Recipe
    from posttrain.runtime.context import RunContext
    from posttrain.stages.dpo import run_dpo
    from posttrain.telemetry import Telemetry

    class Ends:
        def __init__(self) -> None:
            self.ends: list[tuple[float, float]] = []

        def log(self, record: dict) -> None:
            self.ends.append(now())

        def close(self) -> None:
            pass

    cfg = DPOStage(steps=steps, batch_size=pairs, beta=0.1, data=[{"world": "arithmetic", "n": pairs * steps}],
                   eval_per_level=0, log_every=1, save_every=10_000, max_len=160,
                   optim={"lr": 1e-6, "warmup_steps": 0, "weight_decay": 0.0})
    recipe = Recipe(stages=[cfg], dtype=dtype, threads=threads)
    sink = Ends()
    with tempfile.TemporaryDirectory() as run_dir:
        tele = Telemetry.disabled()
        ctx = RunContext(run_dir=Path(run_dir), recipe=recipe, device=torch.device("cpu"), tokenizer=tok, world=world,
                         telemetry=tele, sink=sink, start=policy_dir)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            ctx.console.quiet = True
            run_dpo(cfg, ctx)
    # Everything before the first step (reading, encoding, reference precompute) is one-time.
    return sink.ends, sink.ends[0][0] - t0


def trl_dpo(policy_dir: Path, tok, world, *, pairs: int, steps: int, dtype: str, trl_defaults: bool,
            precompute: bool) -> tuple[list[tuple[float, float]], float, str]:
    """TRL DPOTrainer; returns (step end times, one-time seconds before the first step)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    rows = world.preference_split(pairs * steps)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                             "chosen": [{"role": "assistant", "content": r["chosen"]}],
                             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])

    class Ends(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[tuple[float, float]] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(now())

    precision = {} if trl_defaults else {"bf16": dtype == "bf16", "gradient_checkpointing": False}
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=pairs, max_steps=steps, learning_rate=1e-6,
                         beta=0.1, loss_type="sigmoid", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                         max_length=160, use_cpu=True, report_to="none", save_strategy="no", logging_steps=10_000,
                         dataloader_num_workers=0, disable_tqdm=True, precompute_ref_log_probs=precompute,
                         seed=0, **precision)
        model = AutoModelForCausalLM.from_pretrained(policy_dir, local_files_only=True)
        ends = Ends()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[ends])
            trainer.train()
        settings = f"bf16={args.bf16}, gradient_checkpointing={args.gradient_checkpointing}, precompute_ref_log_probs={precompute}"
    return ends.ends, ends.ends[0][0] - t0, settings


def bench_dpo(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    world = ArithmeticWorld(seed=0)
    tok = world_tokenizer(world)
    model = build_tiny("tiny-30m", vocab_size=len(tok), seed=0, max_seq_len=256,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    print(f"DPO: tiny-30m ({count_parameters(model):,} parameters, vocabulary {len(tok)}), {args.pairs} pairs per step, "
          f"{args.steps} steps ({args.warmup} warm-up), {args.threads} thread(s), dtype {args.dtype}, {args.reps} repetition(s)")
    sides: dict[str, Callable[[Path], tuple]] = {
        "posttrain (reference cached)": lambda p: (*ours_dpo(p, tok, world, pairs=args.pairs, steps=args.steps, dtype=args.dtype,
                                                             threads=args.threads), f"{args.dtype}, no checkpointing, reference cached"),
        "TRL DPOTrainer (same settings)": lambda p: trl_dpo(p, tok, world, pairs=args.pairs, steps=args.steps, dtype=args.dtype,
                                                            trl_defaults=False, precompute=False),
        "TRL DPOTrainer (+ precompute_ref_log_probs)": lambda p: trl_dpo(p, tok, world, pairs=args.pairs, steps=args.steps,
                                                                         dtype=args.dtype, trl_defaults=False, precompute=True),
        "TRL DPOTrainer (its CPU defaults)": lambda p: trl_dpo(p, tok, world, pairs=args.pairs, steps=args.steps, dtype=args.dtype,
                                                               trl_defaults=True, precompute=False),
    }
    per_step: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    one_time: dict[str, list[float]] = {name: [] for name in sides}
    settings: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "policy"
        model.save_pretrained(policy)
        tok.save_pretrained(policy)
        for _ in range(args.reps):
            for name, run in sides.items():
                ends, setup, settings[name] = run(policy)
                per_step[name].append(median_gap(ends, args.warmup))
                one_time[name].append(setup)
    def med(name: str, k: int) -> float:
        return statistics.median(x[k] for x in per_step[name])

    ours = "posttrain (reference cached)"
    print(f"\n{'side':46s} {'CPU s/step':>10s} {'ratio':>7s} {'wall s/step':>11s} {'ratio':>7s} {'one-time s':>10s}  settings")
    for name in sides:
        print(f"{name:46s} {med(name, 1):10.3f} {med(name, 1) / med(ours, 1):6.2f}× {med(name, 0):11.3f} "
              f"{med(name, 0) / med(ours, 0):6.2f}× {statistics.median(one_time[name]):10.2f}  {settings[name]}")
    same = "TRL DPOTrainer (same settings)"
    print(f"\nTRL at the same settings takes {med(same, 1) / med(ours, 1):.2f}× posttrain's CPU time per step "
          f"({med(same, 0) / med(ours, 0):.2f}× its wall time); goal ≥ 1.5×.")


# ==== sections ======================================================================================

def bench_grpo(args: argparse.Namespace) -> None:
    """GRPO step time vs TRL GRPOTrainer: benchmarks/_vs_trl_grpo.py (its own section, its own docstring)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _vs_trl_grpo import bench_grpo as run

    run(steps=args.steps, threads=args.threads, repeats=args.reps)


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {"dpo": bench_dpo, "grpo": bench_grpo}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=sorted(SECTIONS), help="run one section")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides; 1 keeps CPU time honest on a shared machine)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="training precision (both sides)")
    p.add_argument("--pairs", type=int, default=8, help="DPO: pairs per optimizer step")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="step gaps discarded at the start of each run")
    p.add_argument("--reps", type=int, default=1, help="repetitions (sides alternate); medians are reported")
    args = p.parse_args()
    for name, section in SECTIONS.items():
        if args.only in (None, name):
            section(args)


if __name__ == "__main__":
    main()
