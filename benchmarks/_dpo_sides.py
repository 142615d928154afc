"""DPO step time and peak memory: our `dpo` stage vs TRL `DPOTrainer`, each side in its own subprocess.

    python benchmarks/_dpo_sides.py --side posttrain-bf16 --model DIR --pairs FILE --max-len 320   # one side, a JSON line
    python benchmarks/_dpo_sides.py --side posttrain-bf16 … --sdpa-from 512   # the attention kernel's SDPA crossover moved

`benchmarks/scaling.py` drives it (pairs of 64 / 256 / 1,024 tokens); `benchmarks/vs_trl.py --only dpo`
is the older in-process comparison at the world's own short pairs. Both sides: the same weights, the same
preference JSONL (prompt, chosen, rejected), `batch` pairs per optimizer step, sigmoid DPO at β = 0.1, AdamW
at a constant lr, no gradient accumulation. Sides:

- `posttrain-bf16`: our stage at `dtype: bf16` (autocast over fp32 master weights), reference log-probs
  cached once before the loop (its default), prompt shared by chosen and rejected in one forward;
- `trl-fastest`: TRL with `precompute_ref_log_probs=True`, bf16 autocast, no gradient checkpointing — its
  fastest configuration on this CPU;
- `trl-defaults`: TRL's CPU defaults (bf16, gradient checkpointing on, reference recomputed each step).

A step's time is the median gap between consecutive optimizer-step ends after the warm-up, in wall and
process-CPU seconds; one-time work (tokenization, the reference pass) is reported apart.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SIDES = ("posttrain-bf16", "trl-fastest", "trl-defaults")
BETA, LR = 0.1, 1e-6


def _rss_mib() -> float:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork + exec, so a side
    # started by a larger driver would read the driver's peak
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # KiB


def write_pairs(path: Path, tokenizer, *, length: int, n: int, seed: int = 0) -> dict[str, float]:
    """`n` preference pairs whose every sequence (prompt + reply, before the chat template) is `length`
    tokens: a quarter prompt, three quarters reply (UltraFeedback-like proportions), built from the
    arithmetic world's own texts repeated. Returns the measured mean token counts."""
    from posttrain.worlds.arithmetic import ArithmeticWorld

    world = ArithmeticWorld(seed=seed)
    pref = world.preference_split(4 * n + 64)
    problems = [r["prompt"] for r in pref]
    replies = [r["chosen"] for r in pref] + [r["rejected"] for r in pref]

    def text_of(pool: list[str], start: int, tokens: int) -> str:
        ids: list[int] = []
        k = start
        while len(ids) < tokens:
            ids += tokenizer.encode(" " + pool[k % len(pool)], add_special_tokens=False)
            k += 1
        return tokenizer.decode(ids[:tokens], skip_special_tokens=True).strip()

    p_len, r_len = max(4, length // 4), length - max(4, length // 4)
    rows = [{"prompt": text_of(problems, 7 * i, p_len), "chosen": text_of(replies, 11 * i, r_len),
             "rejected": text_of(replies, 11 * i + 5, r_len)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    count = lambda s: len(tokenizer.encode(s, add_special_tokens=False))
    return {"prompt_tokens": statistics.mean(count(r["prompt"]) for r in rows),
            "reply_tokens": statistics.mean(count(r["chosen"]) for r in rows)}


def _gaps(ends: list[tuple[float, float]], warmup: int) -> tuple[float, float]:
    gaps = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(ends)][warmup:]
    return statistics.median(g[0] for g in gaps), statistics.median(g[1] for g in gaps)


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def run_ours(model_dir: Path, pairs: Path, *, steps: int, batch: int, max_len: int, threads: int, warmup: int,
             heap_keep_mib: float | None = None, on_step=None) -> dict:
    """`heap_keep_mib`: the allocator's (default: the recipe's); `on_step()` is called at every step's end."""
    import torch
    from rich.console import Console

    from posttrain.models import load_tokenizer
    from posttrain.runtime.allocator import set_mmap_threshold
    from posttrain.runtime.config import Recipe
    from posttrain.runtime.context import RunContext
    from posttrain.stages.dpo import run_dpo
    from posttrain.tasks import TaskSet
    from posttrain.telemetry import Telemetry

    torch.set_num_threads(threads)
    keep = Recipe.model_fields["heap_keep_mib"].default if heap_keep_mib is None else heap_keep_mib
    set_mmap_threshold(int(Recipe.model_fields["mmap_threshold_mib"].default * 2**20), int(keep * 2**20))  # as `posttrain run` does
    stage = {"stage": "dpo", "steps": steps, "batch_size": batch, "beta": BETA, "data": [{"path": str(pairs)}],
             "max_len": max_len, "eval_per_level": 0, "log_every": 1, "save_every": 10_000,
             "optim": {"lr": LR, "warmup_steps": 0, "weight_decay": 0.0, "min_lr_ratio": 1.0}}
    recipe = Recipe.model_validate({"name": "bench", "threads": threads, "dtype": "bf16", "stages": [stage]})
    ends: list[tuple[float, float]] = []

    class Sink:
        def log(self, r: dict) -> None:
            ends.append(_now())
            if on_step is not None:
                on_step()

        def close(self) -> None:
            pass

    with tempfile.TemporaryDirectory() as run_dir:
        ctx = RunContext(run_dir=Path(run_dir), recipe=recipe, device=torch.device("cpu"),
                         tokenizer=load_tokenizer(model_dir), tasks=TaskSet.of(), telemetry=Telemetry.disabled(),
                         sink=Sink(), start=model_dir, console=Console(quiet=True))
        base = _rss_mib()
        t0 = time.perf_counter()
        run_dpo(recipe.stages[0], ctx)
    wall, cpu = _gaps(ends, warmup)
    return {"side": "posttrain-bf16", "s_per_step": wall, "cpu_s_per_step": cpu, "one_time_s": ends[0][0] - t0,
            "peak_rss_mib": _rss_mib(), "rss_after_setup_mib": base,
            "settings": f"posttrain dpo stage: bf16 autocast over fp32 weights, reference cached, prompt shared, "
                        f"{batch} pairs/step, max_len {max_len}, {threads} thread(s)"}


def run_trl(model_dir: Path, pairs: Path, *, steps: int, batch: int, max_len: int, threads: int, warmup: int,
            mode: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(threads)
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                             "chosen": [{"role": "assistant", "content": r["chosen"]}],
                             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    ends: list[tuple[float, float]] = []

    class Ends(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(_now())

    extra = ({"bf16": True, "gradient_checkpointing": False, "precompute_ref_log_probs": True}
             if mode == "fastest" else {})
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=LR,
                         beta=BETA, loss_type="sigmoid", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                         max_length=max_len, use_cpu=True, report_to="none", save_strategy="no", logging_steps=10_000,
                         dataloader_num_workers=0, disable_tqdm=True, seed=0, **extra)
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(model_dir)
        base = _rss_mib()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[Ends()])
            trainer.train()
    wall, cpu = _gaps(ends, warmup)
    return {"side": f"trl-{mode}", "s_per_step": wall, "cpu_s_per_step": cpu, "one_time_s": ends[0][0] - t0,
            "peak_rss_mib": _rss_mib(), "rss_after_setup_mib": base,
            "settings": f"TRL {__import__('trl').__version__} DPOTrainer: bf16={args.bf16}, gradient_checkpointing="
                        f"{args.gradient_checkpointing}, precompute_ref_log_probs={args.precompute_ref_log_probs}, "
                        f"{batch} pairs/step, max_length {max_len}, {threads} thread(s)"}


def side(name: str, model_dir: Path, pairs: Path, *, steps: int, batch: int, max_len: int, threads: int,
         warmup: int) -> dict:
    """Run one side in a subprocess of its own; its JSON result."""
    import subprocess

    cmd = [sys.executable, __file__, "--side", name, "--model", str(model_dir), "--pairs", str(pairs),
           "--steps", str(steps), "--batch", str(batch), "--max-len", str(max_len), "--threads", str(threads),
           "--warmup", str(warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"DPO side {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=SIDES, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--pairs", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=320)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sdpa-from", type=int, help="ours: keys per query from which the shared-prefix attention runs "
                                                  "through SDPA (posttrain.models.prefix_attention.SDPA_FROM; an A/B)")
    a = ap.parse_args()
    if a.sdpa_from is not None:
        from posttrain.models import prefix_attention

        prefix_attention.SDPA_FROM = a.sdpa_from
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    kw = dict(steps=a.steps, batch=a.batch, max_len=a.max_len, threads=a.threads, warmup=a.warmup)
    r = run_ours(a.model, a.pairs, **kw) if a.side == "posttrain-bf16" else \
        run_trl(a.model, a.pairs, mode=a.side.removeprefix("trl-"), **kw)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
