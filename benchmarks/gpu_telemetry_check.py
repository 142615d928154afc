"""The GPU path of posttrain.telemetry, checked on a real GPU in ≤ 3 minutes: generate MBU, update MFU, busy.

    python benchmarks/gpu_telemetry_check.py                 # on a CUDA GPU (an H200 is the target)
    python benchmarks/gpu_telemetry_check.py --dry-run       # on a CPU: a tiny model, everything but NVML/CUDA

What it exercises, in one process, through the same `Telemetry` a run uses:
- the device table row (H200: dense bf16 989.4 TFLOP/s, 4.8 TB/s HBM3e, its source printed);
- CUDA-event phase timing (no device sync per phase; one wait when a step is folded);
- the NVML busy sampler (`nvidia-ml-py`; without it the busy line is off and the script says so);
- device memory per phase (peak allocated / reserved, reset per phase);
- the `sync` phase: the native engine's weight refresh, timed apart from `generate`;
- the roof revision rule (a rate above a table roof would be stated, never shown above 100%).

The model is a Llama with random weights in the shape of a ~1.2B model (hidden 2048, 16 layers, 32 heads,
8 KV heads, SwiGLU 8192, vocab 32,000): nothing is downloaded, and random weights do the same work per
token as trained ones. Phases: `generate` (the native engine, bf16 copies, batch 64 × 128 prompt tokens
→ 256 new tokens), `update` (AdamW over fp32 master weights, bf16 autocast, batch 8 × 2048 tokens) and
`sync`. The seed's picture for an RL step on an H100-class GPU is ~13% MBU in generate, ~68% MFU in the
update and a busy line of ~97% throughout; this prints the three numbers measured here, to reproduce it
or refute it. Never run in CI: it needs a GPU (the --dry-run is for checking the script itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.rollout import SamplingParams, make_engine  # noqa: E402
from posttrain.telemetry import Telemetry, costs  # noqa: E402
from posttrain.telemetry.busy import source_for  # noqa: E402


def build(device: torch.device, dry: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512) if dry else
             dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32_000))
    cfg = LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=2,
                      pad_token_id=0, bos_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU: check the script, not the GPU")
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="run folder for phases.jsonl/device.json (default: a temp dir)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run on a CPU, or on a lent GPU")
    device = torch.device("cpu" if dry else "cuda")
    out = args.out or Path(tempfile.mkdtemp(prefix="posttrain-gpu-check-"))
    batch, prompt_len, new_tokens = (4, 16, 8) if dry else (64, 128, 256)
    train_batch, train_len = (2, 64) if dry else (8, 2048)

    busy_source = source_for(device)
    tele = Telemetry.open(out, device=device, dtype=torch.bfloat16,
                          peak_flops=1e11 if dry else None, peak_bytes_per_s=1e10 if dry else None,
                          busy=busy_source is not None, busy_source=busy_source)
    print(f"device: {tele.peaks.name} — timing {tele.timing}, memory {tele.memory.meter.kind if tele.memory else 'off'}, "
          f"busy {busy_source.name if busy_source else 'off (pip install nvidia-ml-py)'}")
    print(f"peaks: bf16 {tele.peaks.flops_for('bf16') or 0:.4g} FLOP/s, {tele.peaks.bytes_per_s or 0:.4g} B/s — {tele.peaks.source}")

    model = build(device, dry)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama, {n_params / 1e6:,.0f}M parameters (random weights), fp32 master, bf16 compute")
    engine = make_engine("native", model, None, dtype=torch.bfloat16, eos_token_ids=[2])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=g).tolist()
    train_ids = torch.randint(3, model.config.vocab_size, (train_batch, train_len), generator=g).to(device)

    step = 0
    for i in range(max(args.rollouts, args.updates)):
        step = i + 1
        if i < args.rollouts:
            with tele.phase("generate", stage="check", step=step) as p:
                params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=step)
                ro = engine.generate(prompts, params)
                p.cost = costs.decode(model.config, batch=len(ro), prompt_len=ro.prompt_ids.shape[1],
                                      new_tokens=max(1, ro.completion_ids.shape[1]))
        if i < args.updates:
            with tele.phase("update", stage="check", step=step,
                            cost=costs.train_step(model.config, batch=train_batch, seq_len=train_len)):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(input_ids=train_ids, labels=train_ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            with tele.phase("sync", stage="check", step=step) as p:
                p.cost = costs.Cost(bytes=engine.sync_weights(model))
        m = tele.step_metrics(stage="check", step=step)
        print(f"step {step}: " + ", ".join(f"{k.split('/')[1]} {m[k]:.3f}s" for k in m if k.endswith("/seconds")))
        if time.perf_counter() - t_start > 150:
            print("stopping early: the 3-minute budget")
            break
    tele.close()

    from posttrain.telemetry import read_phases

    recs = read_phases(out / "phases.jsonl")
    device_json = json.loads((out / "device.json").read_text())
    peak_f, peak_b = device_json["peaks"]["flops"].get("bf16"), device_json["peaks"]["bytes_per_s"]

    def summary(name: str) -> dict[str, float | None]:
        rs = [r for r in recs if r.name == name][1:] or [r for r in recs if r.name == name]  # the first warms up
        sec = sum(r.seconds for r in rs)
        busy = [r.busy for r in rs if r.busy is not None]
        return {"seconds": statistics.median(r.seconds for r in rs),
                "mfu": 100 * sum(r.flops for r in rs) / sec / peak_f if peak_f and sec else None,
                "mbu": 100 * sum(r.bytes for r in rs) / sec / peak_b if peak_b and sec else None,
                "busy": 100 * statistics.fmean(busy) if busy else None,
                "mem_gib": max((r.mem_peak or 0) for r in rs) / 2**30,
                "bytes": statistics.median(r.bytes for r in rs)}

    def f(x: float | None, unit: str = "%") -> str:
        return "—" if x is None else f"{x:.1f}{unit}"

    gen, upd, syn = summary("generate"), summary("update"), summary("sync")
    print(f"\ngenerate: MBU {f(gen['mbu'])} (MFU {f(gen['mfu'])}), busy {f(gen['busy'])}, "
          f"{gen['seconds']:.3f} s median, peak memory {gen['mem_gib']:.2f} GiB")
    print(f"update:   MFU {f(upd['mfu'])} (MBU {f(upd['mbu'])}), busy {f(upd['busy'])}, "
          f"{upd['seconds']:.3f} s median, peak memory {upd['mem_gib']:.2f} GiB")
    print(f"sync:     {syn['bytes'] / 1e9:.2f} GB in {syn['seconds']:.4f} s = "
          f"{syn['bytes'] / 1e9 / max(syn['seconds'], 1e-12):.1f} GB/s, MBU {f(syn['mbu'])}")
    for r in device_json.get("revisions", []):
        print(f"roof revised: {r}")
    print(f"busy line (whole run): {f(statistics.fmean(r.busy for r in recs if r.busy is not None) * 100 if any(r.busy is not None for r in recs) else None)}")
    print(f"seed's picture: generate MBU ~13%, update MFU ~68%, busy ~97% · run folder {out} · "
          f"{time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
