"""Peak memory and step time of GRPO on SmolLM2-135M-Instruct: LoRA against full fine-tuning, same batch.

    python benchmarks/lora_memory.py                       # 3 rollouts each side, 4 prompts × G=4, 24 new tokens
    python benchmarks/lora_memory.py --steps 5 --prompts 8 --threads 2
    python benchmarks/lora_memory.py --steps 2 --prompts 2 --new-tokens 16 --together   # a busy machine

Each side runs in its own fresh subprocess (peak RSS is a high-water mark: two sides in one process
would read the larger), driving the real `grpo` stage (`posttrain.stages.grpo.run_grpo`) on a file of
2-digit additions ("reply with the number only") with the `math` verifier and a KL term (kl_coef > 0,
so the reference is used: a second copy of the weights under full fine-tuning, the same weights with
the adapters disabled under LoRA). Both sides use the same seed, prompts, group size, token budget,
thread count and dtype (fp32). Printed per side: peak RSS of the stage's process over the whole run (`VmHWM`:
loading, rollouts, reference, updates), trainable parameters, the rollout engine's kernels, and
seconds per rollout (generate + score + reference + update + weight refresh); then the ratios.
The math verifier's worker processes are not counted (their RSS is the same for both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def rss_mib() -> float:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork + exec, so a side
    # started by a larger driver would read the driver's peak
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # KiB


def problems_file(folder: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"What is {a} + {b}? Reply with the number only.", "answer": str(a + b)})
    path = folder / "additions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def side(args: argparse.Namespace) -> None:
    """One side, in this process: print one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    from rich.console import Console

    from posttrain.models import load_tokenizer, smollm2_135m_instruct
    from posttrain.runtime.config import GRPOStage, Recipe
    from posttrain.runtime.context import RunContext
    from posttrain.stages.grpo import run_grpo
    from posttrain.telemetry import Telemetry
    from posttrain.worlds.arithmetic import ArithmeticWorld

    class Sink:
        def __init__(self) -> None:
            self.records: list[dict] = []

        def log(self, record: dict) -> None:
            self.records.append(record)

        def close(self) -> None:
            pass

    start = smollm2_135m_instruct()
    work = Path(tempfile.mkdtemp(prefix=f"lora-mem-{args.side}-"))
    data = problems_file(work, 64, seed=0)
    cfg = GRPOStage(steps=args.steps, batch_size=args.prompts * args.group, group_size=args.group,
                    max_new_tokens=args.new_tokens, max_prompt_len=96, kl_coef=0.04, log_every=1,
                    save_every=args.steps, temperature=1.0, data=[{"path": str(data)}], rewards=[{"name": "math"}],
                    optim={"lr": 1e-4 if args.side == "lora" else 1e-6, "warmup_steps": 0, "min_lr_ratio": 1.0})
    model = {"init": str(start)}
    if args.side == "lora":
        model["lora"] = {"r": args.r, "alpha": 2.0 * args.r, "dropout": 0.0, "target_modules": TARGETS}
    recipe = Recipe(stages=[cfg], threads=args.threads, model=model)
    sink = Sink()
    torch.manual_seed(0)
    engines = []
    orig = RunContext.rollout_engine

    def spy(self, m, backend="native"):
        engines.append(orig(self, m, backend))
        return engines[-1]

    RunContext.rollout_engine = spy  # to report which kernels sampled
    ctx = RunContext(run_dir=work, recipe=recipe, device=torch.device("cpu"), tokenizer=load_tokenizer(start),
                     world=ArithmeticWorld(seed=0), telemetry=Telemetry.disabled(), sink=sink, start=start,
                     console=Console(quiet=True))
    t0 = time.perf_counter()
    run_grpo(cfg, ctx)
    wall = time.perf_counter() - t0
    recs = [r for r in sink.records if r.get("stage") == "grpo"]
    from posttrain.models import lora

    print(json.dumps({
        "side": args.side, "peak_rss_mib": rss_mib(), "wall_s": wall,
        "seconds_per_rollout": [r["train/seconds_per_rollout"] for r in recs],
        "reward": [r.get("reward/total") for r in recs],
        "kernels": engines[0].kernels if engines else None,
        "lora_r": args.r if args.side == "lora" else None,
        "trainable": None if not engines else lora.trainable_parameters(engines[0].model)[0],
        "total": None if not engines else lora.trainable_parameters(engines[0].model)[1],
    }))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=["full", "lora"], help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3, help="rollouts (= optimizer steps, μ = 1) per side")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--together", action="store_true", help="run both sides at once (peak RSS is per process and "
                                                             "unaffected; the step times then share the CPU)")
    args = ap.parse_args()
    if args.side:
        side(args)
        return
    out, procs = {}, {}
    for name in ("full", "lora"):
        cmd = [sys.executable, __file__, "--side", name] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                            if k not in ("side", "together")]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if not args.together:  # one at a time: the step times do not share the CPU
            procs[name].wait()
    for name, proc in procs.items():
        stdout, stderr = proc.communicate()
        if proc.returncode:
            sys.exit(f"{name} side failed:\n{stderr[-3000:]}")
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    print(f"GRPO on SmolLM2-135M-Instruct, fp32, {args.prompts} prompts × G={args.group} = {args.prompts * args.group} "
          f"sequences × ≤ {args.new_tokens} new tokens, KL to the reference on, {args.steps} rollouts, {args.threads} threads"
          f"{', both sides at once' if args.together else ''}")
    for name, r in out.items():
        steps = r["seconds_per_rollout"]
        print(f"  {name:>4}: peak RSS {r['peak_rss_mib']:,.0f} MiB; trainable {r['trainable']:,} of {r['total']:,} "
              f"({100 * r['trainable'] / r['total']:.2f}%); kernels {r['kernels']}; s/rollout "
              f"{', '.join(f'{s:.2f}' for s in steps)} (median {statistics.median(steps):.2f}); rewards {r['reward']}")
    f, lo = out["full"], out["lora"]
    print(f"  LoRA / full: peak RSS {lo['peak_rss_mib'] / f['peak_rss_mib']:.2f}× "
          f"({f['peak_rss_mib'] - lo['peak_rss_mib']:,.0f} MiB less); median s/rollout "
          f"{statistics.median(lo['seconds_per_rollout']) / statistics.median(f['seconds_per_rollout']):.2f}×")


if __name__ == "__main__":
    main()
