"""Telemetry benchmark: (1) what it costs, (2) that its verdicts follow the physics on this CPU.

    python benchmarks/telemetry_overhead.py [--steps 40] [--repeats 3] [--remeasure]

1. Overhead: the same SFT-like loop of a tiny Llama (built from a LlamaConfig) run with telemetry off
   and on (phase around each update, step_metrics + metrics.jsonl per step, busy sampler at 20 Hz),
   alternating off/on step by step, same number of steps each; prints the median on/off step-time ratio, and the
   cost of one empty phase in µs (a noise-free bound: phases per step × that cost ÷ step time).
   Must hold: overhead ≤ 2%.
2. Roofline: a tiny-30m SFT update at 2,048 tokens per step should land near the compute roof;
   batch-1 greedy decode of tiny-1m far under the roof its intensity allows (overhead-bound); both
   with the busy line reading high. Prints the `posttrain phases` table of the run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from posttrain.telemetry import Telemetry, costs
from posttrain.telemetry.cli import phases_command
from posttrain.telemetry.devices import load_cpu_peaks, measure_cpu_peaks
from posttrain.telemetry.sinks import JsonlSink

TINY_1M = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
           "intermediate_size": 344, "vocab_size": 512, "tie_word_embeddings": True}
TINY_30M = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
            "intermediate_size": 1376, "vocab_size": 2048, "tie_word_embeddings": True}


def build(shape: dict) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**shape, max_position_embeddings=2048)
    return LlamaForCausalLM(config)


def sft_steps(model: LlamaForCausalLM, opt: torch.optim.Optimizer, batch: int, seq_len: int, steps: int,
              tele: Telemetry | None, sink: JsonlSink | None, stage: str, step0: int = 0) -> list[float]:
    """Run `steps` updates; returns each step's wall time (telemetry included when on)."""
    vocab = model.config.vocab_size
    cost = costs.train_step(model.config, batch=batch, seq_len=seq_len)
    times = []
    for i in range(steps):
        ids = torch.randint(0, vocab, (batch, seq_len))
        t = time.perf_counter()
        if tele is None:
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with tele.phase("update", stage=stage, step=step0 + i + 1, cost=cost):
                loss = model(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            metrics = tele.step_metrics(stage=stage, step=step0 + i + 1)
            if sink is not None:
                sink.log({"stage": stage, "step": step0 + i + 1, "loss/sft": loss.item(), **metrics})
        times.append(time.perf_counter() - t)
    return times


@torch.no_grad()
def greedy_decode(model: LlamaForCausalLM, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Plain greedy loop over a DynamicCache: one prefill, then one token per forward."""
    cache = DynamicCache(config=model.config)
    out = model(prompt, cache=cache, use_cache=True, logits_to_keep=1)
    tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]  # (B, 1)
    for _ in range(new_tokens - 1):
        out = model(tokens[-1], cache=cache, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)  # (B, new_tokens)


def overhead(steps: int, repeats: int, run_dir: Path) -> None:
    model = build(TINY_1M)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch, seq_len = 8, 128
    sft_steps(model, opt, batch, seq_len, 3, None, None, "warm")  # warm-up: allocator, kernels
    tele = Telemetry.open(run_dir / "overhead", device="cpu", dtype=torch.float32)
    sink = JsonlSink(run_dir / "overhead" / "metrics.jsonl")
    # off and on alternate step by step (ABAB…), so load from other jobs hits both alike
    ratios, off_all, on_all = [], [], []
    for r in range(repeats):
        off, on = [], []
        for i in range(steps):
            off += sft_steps(model, opt, batch, seq_len, 1, None, None, "sft")
            on += sft_steps(model, opt, batch, seq_len, 1, tele, sink, "sft", r * steps + i)
        ratios.append(statistics.median(on) / statistics.median(off))
        off_all += off
        on_all += on
    # the noise-free bound: one empty phase + step_metrics + a metrics line, timed 2,000 times
    n = 2000
    t = time.perf_counter()
    for i in range(n):
        with tele.phase("update", stage="micro", step=i, cost=costs.Cost(1.0, 1.0)):
            pass
        sink.log({"stage": "micro", "step": i, **tele.step_metrics(stage="micro", step=i)})
    per_phase = (time.perf_counter() - t) / n
    tele.close()
    sink.close()
    step = statistics.median(off_all)
    print(f"\n== overhead: tiny-1m SFT loop, batch {batch} × {seq_len}, {steps} steps × {repeats} repeats ==")
    print(f"median step: off {1e3 * step:.1f} ms, on {1e3 * statistics.median(on_all):.1f} ms; "
          f"on/off ratios {', '.join(f'{x:.3f}' for x in ratios)} → median {statistics.median(ratios):.3f}")
    print(f"one phase + step_metrics + metrics line: {1e6 * per_phase:.0f} µs "
          f"= {100 * per_phase / step:.2f}% of a {1e3 * step:.1f} ms step (noise-free bound; must be ≤ 2%)")


def roofline_demo(run_dir: Path, remeasure: bool) -> None:
    peaks = None if remeasure else load_cpu_peaks()
    if peaks is None:
        print("measuring CPU roofs (a few seconds)…")
        peaks = measure_cpu_peaks()
    print(f"\n== roofline demo on {peaks.name}: fp32 {peaks.flops['fp32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks.flops.get('bf16', 0) / 1e9:.0f} GFLOP/s, read {peaks.bytes_per_s / 1e9:.1f} GB/s ==")
    demo = run_dir / "demo"
    tele = Telemetry.open(demo, device="cpu", dtype=torch.float32, peaks=peaks)

    big = build(TINY_30M)
    opt = torch.optim.AdamW(big.parameters(), lr=1e-4)
    batch, seq_len = 4, 512
    sft_steps(big, opt, batch, seq_len, 1, None, None, "warm")
    sft_steps(big, opt, batch, seq_len, 3, tele, None, "sft")

    for label, shape in (("tiny-1m", TINY_1M), ("tiny-30m", TINY_30M)):
        model = build(shape).eval()
        prompt = torch.randint(0, shape["vocab_size"], (1, 16))
        greedy_decode(model, prompt, 8)  # warm-up
        new = 64
        for step in (1, 2, 3):
            with tele.phase("generate", stage=f"decode-{label}", step=step) as p:
                out = greedy_decode(model, prompt, new)
                p.cost = costs.decode(model.config, batch=1, prompt_len=16, new_tokens=out.shape[1])
            tele.step_metrics(stage=f"decode-{label}", step=step)
    tele.close()
    phases_command(demo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--remeasure", action="store_true", help="re-measure the CPU roofs instead of the cache")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared CPU, OpenMP threads wait on descheduled "
                             "peers and a 2-thread decode ran 20x slower than a 1-thread one here)")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads "
          "(numbers depend on what else shares the CPU)")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_overhead:
            overhead(args.steps, args.repeats, Path(tmp))
        if not args.skip_demo:
            roofline_demo(Path(tmp), args.remeasure)


if __name__ == "__main__":
    main()
