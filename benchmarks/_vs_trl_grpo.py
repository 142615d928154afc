"""GRPO step time: our `grpo` stage vs TRL `GRPOTrainer`, same tiny-30m weights, same data, same shape.

    python benchmarks/_vs_trl_grpo.py                  # 6 measured steps per side, 2 threads
    python benchmarks/_vs_trl_grpo.py --steps 8 --repeats 3       # the figures in docs/rlvr.md

Both sides: the same randomly initialised tiny-30m Llama (built once, saved, loaded by each side), the
same arithmetic-world problems (a JSONL file both read), G = 8 samples per prompt, 16 sequences per
optimizer step (2 prompts), 32 completion tokens at most, temperature 1, KL coefficient 0, one
update per rollout (μ = 1), the same reward (the world's gold judge), AdamW at the same lr. Each side
runs in its own subprocess so peak memory (max RSS) is its own; a step's time is wall clock from one
optimizer step's end to the next, and the process CPU time over the same span (the number to read
when other jobs share the cores, best with --threads 1), the first (warm-up) step dropped, medians.

Five sides, each in its own subprocess: ours in fp32 and in bf16 (autocast over fp32 master weights
for the update, rollouts from bf16 weight copies); TRL with its CPU defaults (GRPOConfig: bf16
autocast where supported, gradient checkpointing on), in plain fp32 without checkpointing, and in
bf16 autocast without checkpointing. Each of ours is compared with TRL at the same precision and
with TRL's defaults; every side's settings are printed. `bench_grpo()` is what `benchmarks/vs_trl.py` calls.

Each side's step is also split into its rollout (sampling the G completions and scoring them) and
the rest (the update: forward, backward, optimizer, and whatever else the trainer does), medians per
step: ours' rollout is the stage's own telemetry phases `generate` + `score`, TRL's the time inside
`GRPOTrainer._generate_and_score_completions`; the rest is the step's time less the rollout. The speed-up is printed for each part,
so it shows where it comes from; our phases are placed on this CPU's roofline when its peaks are cached
(`posttrain roofline --measure`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

G, SEQS, COMPLETION, LR = 8, 16, 32, 1e-6
TRL_MODES = {"defaults": "CPU defaults", "fp32": "plain fp32", "bf16": "bf16 autocast, no checkpointing",
             "paged": "bf16 autocast, no checkpointing, transformers' paged (continuous-batching) generate"}
SIDES = ("posttrain-fp32", "posttrain-bf16", "trl-defaults", "trl-fp32", "trl-bf16", "trl-paged")
LORA = {"r": 16, "alpha": 32}  # on every linear layer, both sides (PEFT's target_modules="all-linear")
# each of ours against the TRL configurations it is compared with (same precision; TRL's defaults are bf16)
PAIRS = {"posttrain-fp32": ("trl-fp32", "trl-defaults"), "posttrain-bf16": ("trl-bf16", "trl-defaults")}


def _rss_mib() -> float:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork + exec, so a side
    # started by a larger driver would read the driver's peak
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # KiB


def prepare(folder: Path, *, problems: int = 512, max_seq_len: int = 160) -> tuple[Path, Path]:
    """The shared tiny-30m folder (weights + tokenizer) and problem JSONL."""
    from posttrain.models import build_tiny, train_tokenizer
    from posttrain.worlds.arithmetic import ArithmeticWorld

    world = ArithmeticWorld(seed=0)
    texts = list(world.pretrain_documents(2000))
    texts += [f"user\n{ex[0]['content']}\nassistant\n{ex[1]['content']}" for ex in world.sft_split(1000)]
    tok = train_tokenizer(texts, vocab_size=512)
    model = build_tiny("tiny-30m", vocab_size=len(tok), seed=0, max_seq_len=max_seq_len,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model_dir, data = folder / "tiny-30m", folder / "problems.jsonl"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows = world.problems(problems, seed_offset=5)
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"], "level": r["level"]}) + "\n"
                            for r in rows))
    return model_dir, data


# ---- our side --------------------------------------------------------------------------------------
def run_ours(model_dir: Path, data: Path, steps: int, threads: int, *, bf16: bool, completion: int = COMPLETION,
             lora: bool = False, overrides: dict | None = None, mmap_threshold_mib: float | None = None,
             heap_keep_mib: float | None = None, on_step=None) -> dict:
    """`overrides`: fields of our grpo stage to set (an A/B of one setting in one process).
    `mmap_threshold_mib`, `heap_keep_mib`: the host allocator's thresholds (default: the recipe's, as
    `posttrain run` sets them).
    `on_step(record)`: called at the end of every step with the step's metrics."""
    import torch
    from rich.console import Console

    from posttrain.models import load_tokenizer
    from posttrain.runtime.allocator import set_mmap_threshold
    from posttrain.runtime.config import Recipe
    from posttrain.runtime.context import RunContext
    from posttrain.stages.grpo import run_grpo
    from posttrain.telemetry import Telemetry
    from posttrain.tasks import TaskSet
    from posttrain.tasks.arithmetic import ArithmeticTask
    from posttrain.worlds.arithmetic import ArithmeticWorld

    torch.set_num_threads(threads)
    mib = Recipe.model_fields["mmap_threshold_mib"].default if mmap_threshold_mib is None else mmap_threshold_mib
    keep = Recipe.model_fields["heap_keep_mib"].default if heap_keep_mib is None else heap_keep_mib
    set_mmap_threshold(int(mib * 2**20), int(keep * 2**20))  # as `posttrain run` does (runtime/allocator.py)
    stage = {"stage": "grpo", "steps": steps + 1, "batch_size": SEQS, "group_size": G, "max_new_tokens": completion, "max_prompt_len": 160,
             "temperature": 1.0, "kl_coef": 0.0, "loss": "dapo", "mu": 1, "rewards": [{"name": "gold"}],
             "data": [{"path": str(data)}], "log_every": 1, "save_every": steps + 1,
             "optim": {"lr": LR, "warmup_steps": 0, "min_lr_ratio": 1.0}, **(overrides or {})}
    recipe = Recipe.model_validate({"name": "bench", "threads": threads, "dtype": "bf16" if bf16 else "fp32",
                                    "stages": [stage], **({"model": {"lora": LORA}} if lora else {})})
    records: list[dict] = []
    cpu: list[float] = []

    class Sink:
        def log(self, r: dict) -> None:  # called once at the end of every step (log_every 1)
            records.append(r)
            cpu.append(time.process_time())
            if on_step is not None:
                on_step(r)

        def close(self) -> None:
            pass

    with tempfile.TemporaryDirectory() as run_dir:
        # the stage's phases timed (a clock read each; no busy sampler, no files): the split below
        # memory=False: the phase meter resets the kernel's high-water mark at every phase (clear_refs), which
        # would leave the process peak read below (VmHWM) covering only the last phase
        telemetry = Telemetry.open(None, device="cpu", dtype=torch.bfloat16 if bf16 else torch.float32, busy=False,
                                   memory=False)
        ctx = RunContext(run_dir=Path(run_dir), recipe=recipe, device=torch.device("cpu"),
                         tokenizer=load_tokenizer(model_dir), tasks=TaskSet.of(ArithmeticTask(world=ArithmeticWorld(seed=0))),
                         telemetry=telemetry, sink=Sink(), start=model_dir, console=Console(quiet=True))
        base = _rss_mib()
        run_grpo(recipe.stages[0], ctx)
    times = [r["train/seconds_per_rollout"] for r in records][1:]
    phase = lambda r, name: r.get(f"phase/{name}/seconds", 0.0)
    rollout = [phase(r, "generate") + phase(r, "score") for r in records][1:]
    roofline = {name: {k: records[-1].get(f"phase/{name}/{k}") for k in ("flops_per_s", "bytes_per_s", "bound")}
                for name in ("generate", "update")}
    cpu_times = [b - a for a, b in itertools.pairwise(cpu)]  # from the end of step 1: warm-up dropped
    precision = ("bf16 autocast over fp32 master weights, rollout from bf16 weight copies (fp32 attention "
                 "over a bf16 KV cache where the C kernels run)" if bf16 else "fp32")
    settings = (f"posttrain grpo stage: {precision}, no activation checkpointing, native rollout engine (KV cache, "
                f"fused Llama kernels), loss dapo (token mean, clip 0.8–1.28), G={G}, {SEQS} seq/step, ≤{completion} new "
                f"tokens, {'LoRA r 16 α 32 on every linear' if lora else 'full fine-tuning'}, T=1, kl_coef 0, μ=1, grad_accum 1, AdamW lr {LR}, {threads} threads")
    return {"side": "posttrain-bf16" if bf16 else "posttrain-fp32", "settings": settings, "s_per_step": statistics.median(times),
            "cpu_s_per_step": statistics.median(cpu_times), "steps": len(times),
            "peak_rss_mib": _rss_mib(), "rss_after_setup_mib": base,
            "rollout_s": statistics.median(rollout), "rest_s": statistics.median(t - g for t, g in zip(times, rollout)),
            "roofline": roofline,
            "completion_tokens_mean": statistics.mean(r["response/length_mean"] for r in records)}


# ---- TRL -------------------------------------------------------------------------------------------
def run_trl(model_dir: Path, data: Path, steps: int, threads: int, *, mode: str, completion: int = COMPLETION,
            lora: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.stages._rlvr import world_gold

    torch.set_num_threads(threads)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows])

    def gold(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(x) for x in world_gold(texts, answer=answer)]

    stamps: list[float] = []
    cpu: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    extra = {"defaults": {}, "fp32": {"bf16": False, "gradient_checkpointing": False},
             "bf16": {"bf16": True, "gradient_checkpointing": False},
             "paged": {"bf16": True, "gradient_checkpointing": False, "use_transformers_paged": True}}[mode]
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=SEQS, num_generations=G,
                          max_completion_length=completion, temperature=1.0, beta=0.0, num_iterations=1,
                          loss_type="dapo", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                          max_steps=steps + 1, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                          disable_tqdm=True, **extra)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(model_dir)
        peft = None
        if lora:
            from peft import LoraConfig

            peft = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear",
                              task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=model, reward_funcs=gold, args=args, train_dataset=ds, processing_class=tok,
                              callbacks=[Clock()], peft_config=peft)
        generate_and_score = trainer._generate_and_score_completions
        rollout_seconds: list[float] = []

        def timed_rollout(*a, **k):  # the rollout of each step: sampling + rewards (+ any log-prob pass it makes)
            t0 = time.perf_counter()
            out = generate_and_score(*a, **k)
            rollout_seconds.append(time.perf_counter() - t0)
            return out
        trainer._generate_and_score_completions = timed_rollout
        base = _rss_mib()
        start = time.perf_counter()
        trainer.train()
    ends = [start] + stamps
    times = [b - a for a, b in itertools.pairwise(ends)][1:]
    a = trainer.args
    settings = (f"TRL {__import__('trl').__version__} GRPOTrainer ({TRL_MODES[mode]}): "
                f"bf16={a.bf16}, gradient_checkpointing={a.gradient_checkpointing}, loss {a.loss_type}, "
                f"G={a.num_generations}, {a.per_device_train_batch_size} seq/step, ≤{a.max_completion_length} new tokens, "
                f"T={a.temperature}, beta {a.beta}, num_iterations {a.num_iterations}, "
                f"{'LoRA r 16 α 32 on every linear, ' if lora else ''}"
                f"transformers generate, AdamW lr {a.learning_rate}, {threads} threads")
    rollout = rollout_seconds[1:len(times) + 1]  # one per step (μ = 1), the warm-up step's dropped
    if len(rollout) != len(times):
        raise RuntimeError(f"TRL generated {len(rollout_seconds)} times in {len(times) + 1} steps; the split "
                           "assumes one rollout per step")
    return {"side": f"trl-{mode}", "settings": settings,
            "s_per_step": statistics.median(times),
            "rollout_s": statistics.median(rollout), "rest_s": statistics.median(t - g for t, g in zip(times, rollout)),
            "cpu_s_per_step": statistics.median(b - a for a, b in itertools.pairwise(cpu)),
            "steps": len(times), "peak_rss_mib": _rss_mib(),
            "rss_after_setup_mib": base, "completion_tokens_mean": statistics.mean(lengths) if lengths else float("nan")}


# ---- driver ----------------------------------------------------------------------------------------
def _side(side: str, model_dir: Path, data: Path, steps: int, threads: int, *, completion: int = COMPLETION,
          lora: bool = False) -> dict:
    """One side in its own subprocess (its peak RSS is its own); the JSON line it prints."""
    cmd = [sys.executable, __file__, "--side", side, "--model", str(model_dir), "--data", str(data),
           "--steps", str(steps), "--threads", str(threads), "--completion", str(completion)] + ["--lora"] * lora
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _roofline_text(roofline: dict | None) -> str:
    """Our phases on the CPU roofline (last step), when the peaks were known."""
    if not roofline:
        return ""
    bits = [f"{name} {v['flops_per_s'] / 1e9:.0f} GFLOP/s, {v['bytes_per_s'] / 1e9:.1f} GB/s, {v['bound']}-bound"
            for name, v in roofline.items() if v.get("flops_per_s") is not None and v.get("bound")]
    return f"; roofline: {'; '.join(bits)}" if bits else ""


def bench_grpo(steps: int = 6, threads: int = 2, sides: tuple[str, ...] = SIDES[:5], repeats: int = 1) -> dict:
    """Run the sides `repeats` times (the order reversed on every other round, so slow drifts of the
    machine hit both), print settings, s/step, peak memory and the speed-ups; return the numbers.

    Each side's figures are medians over rounds; each speed-up is the median over rounds of the ratio
    within a round (the two sides ran minutes apart, not hours)."""
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as folder:
        model_dir, data = prepare(Path(folder))
        for k in range(repeats):
            order = sides if k % 2 == 0 else tuple(reversed(sides))
            rounds.append({s: _side(s, model_dir, data, steps, threads) for s in order})
    med = statistics.median
    results = {s: {**rounds[0][s], **{key: med(r[s][key] for r in rounds)
                                       for key in ("s_per_step", "cpu_s_per_step", "peak_rss_mib", "rollout_s", "rest_s")},
                   "rounds_s_per_step": [r[s]["s_per_step"] for r in rounds]} for s in sides}
    print(f"\nGRPO step, tiny-30m, G={G}, {SEQS} sequences/step, ≤{COMPLETION} completion tokens, KL 0 "
          f"(median of {steps} steps after 1 warm-up, median over {repeats} round(s); {threads} threads)")
    for r in results.values():
        spread = ", ".join(f"{x:.3f}" for x in r["rounds_s_per_step"])
        print(f"  {r['side']:<15} {r['s_per_step']:6.3f} s/step wall ({spread}), {r['cpu_s_per_step']:6.3f} s/step CPU   "
              f"peak RSS {r['peak_rss_mib']:7.0f} MiB   mean completion {r['completion_tokens_mean']:.1f} tokens")
        print(f"      split: rollout {r['rollout_s']:.3f} s (sample + score), update and the rest {r['rest_s']:.3f} s"
              + _roofline_text(r.get("roofline")))
        print(f"      {r['settings']}")
    for ours, theirs in PAIRS.items():
        for side in theirs:
            if ours in results and side in results:
                wall = [r[side]["s_per_step"] / r[ours]["s_per_step"] for r in rounds]
                cpu = [r[side]["cpu_s_per_step"] / r[ours]["cpu_s_per_step"] for r in rounds]
                parts = {part: med(r[side][f"{part}_s"] / r[ours][f"{part}_s"] for r in rounds) for part in ("rollout", "rest")}
                print(f"  {ours} vs {side}: {med(wall):.2f}× wall ({', '.join(f'{x:.2f}' for x in wall)}), "
                      f"{med(cpu):.2f}× CPU time   (target ≥ 2.5×); rollout {parts['rollout']:.2f}×, "
                      f"update and the rest {parts['rest']:.2f}×")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--side", choices=SIDES, help="run one side in this process (the driver's subprocess)")
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES[:5]), help="the sides to run")
    ap.add_argument("--completion", type=int, default=COMPLETION, help="completion tokens at most (a side's setting)")
    ap.add_argument("--lora", action="store_true", help="LoRA adapters instead of full fine-tuning (a side's setting)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the sides (medians; order alternates)")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--data", type=Path)
    a = ap.parse_args()
    if a.side is None:
        bench_grpo(a.steps, a.threads, tuple(a.sides), a.repeats)
        return
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.side.startswith("posttrain"):
        r = run_ours(a.model, a.data, a.steps, a.threads, bf16=a.side == "posttrain-bf16", completion=a.completion, lora=a.lora)
    else:
        r = run_trl(a.model, a.data, a.steps, a.threads, mode=a.side.removeprefix("trl-"), completion=a.completion, lora=a.lora)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
