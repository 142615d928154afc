"""The host allocator's thresholds (`mmap_threshold_mib`, `heap_keep_mib`; posttrain/runtime/allocator.py):
time, page faults and memory of our GRPO or DPO step at each setting, in one invocation.

    python benchmarks/allocator.py --completion 128 --steps 4 --arms 4 32
    python benchmarks/allocator.py --completion 32 --steps 9 --arms 32:64 32:1024 --repeats 4
    python benchmarks/allocator.py --dpo 1024 --steps 5 --arms 32:64 32:1024 --repeats 2
    python benchmarks/allocator.py --dpo 64 --steps 8 --arms 32:1024 32:1024+thp --repeats 2

An arm is `MMAP` or `MMAP:KEEP` (MiB; KEEP defaults to the recipe's `heap_keep_mib`; `32:64` is the heap
trimmed at twice the mmap threshold, the setting before `heap_keep_mib`); a trailing `+thp` runs the arm with
torch's transparent-huge-page allocation on (`THP_MEM_ALLOC_ENABLE=1`: blocks of 2 MiB and more aligned to
2 MiB and advised MADV_HUGEPAGE), every other arm with it off. GRPO: tiny-30m random init, bf16,
the shape of `benchmarks/scaling.py` (2 prompts × G 8, T 1, μ 1); `--dpo LEN`: the DPO stage of
`benchmarks/_dpo_sides.py` on 8 pairs of LEN tokens a step instead. One thread. Each arm runs in its own
subprocess (the allocator is process-wide), the arms' order alternating between repeats. Per arm: seconds
per step (median after the first), process CPU seconds per step, minor page faults and system CPU
milliseconds per step (medians after the first), and for every step the resident set's high-water mark
during the step and the resident set at its end (`VmHWM` reset at each step's end through
/proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _dpo_sides as dpo_sides  # noqa: E402
import _vs_trl_grpo as grpo_sides  # noqa: E402


def _status_mib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:")) // 1024


def arm(spec: str, model_dir: Path, data: Path, *, completion: int, steps: int, dpo: int | None = None) -> dict:
    mib, _, keep = spec.removesuffix("+thp").partition(":")
    per_step: list[dict] = []
    usage = [resource.getrusage(resource.RUSAGE_SELF)]

    def on_step(r: dict | None = None) -> None:
        usage.append(resource.getrusage(resource.RUSAGE_SELF))
        per_step.append({"peak_mib": _status_mib("VmHWM"), "end_rss_mib": _status_mib("VmRSS"),
                         "completion_mean": (r or {}).get("response/length_mean")})
        Path("/proc/self/clear_refs").write_text("5")  # the next step's high-water mark is its own

    if dpo is None:
        out = grpo_sides.run_ours(model_dir, data, steps, 1, bf16=True, completion=completion,
                                  mmap_threshold_mib=float(mib), heap_keep_mib=float(keep) if keep else None,
                                  on_step=on_step)
    else:
        if float(mib) != 32:
            raise SystemExit("--dpo arms run at the recipe's mmap threshold (32): give 32:KEEP")
        out = dpo_sides.run_ours(model_dir, data, steps=steps + 1, batch=8, max_len=dpo + 32, threads=1, warmup=1,
                                 heap_keep_mib=float(keep) if keep else None, on_step=on_step)
    steps_after_first = list(zip(usage[1:], usage[2:]))
    return {"arm": spec, "s_per_step": out["s_per_step"], "cpu_s_per_step": out["cpu_s_per_step"],
            "faults_per_step": statistics.median(b.ru_minflt - a.ru_minflt for a, b in steps_after_first),
            "sys_ms_per_step": statistics.median(1e3 * (b.ru_stime - a.ru_stime) for a, b in steps_after_first),
            "steps": per_step, "peak_mib": max(s["peak_mib"] for s in per_step)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="measured steps after the warm-up")
    ap.add_argument("--arms", nargs="+", default=["4", "32"], help="MMAP or MMAP:KEEP, in MiB")
    ap.add_argument("--dpo", type=int, help="the DPO stage at pairs of this many tokens instead of GRPO")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--arm", help="run one arm in this process (the driver's subprocess)")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--folder", type=Path, help="where the shared model and problems are built (default: a temp dir)")
    a = ap.parse_args()
    if a.arm is not None:
        print(json.dumps(arm(a.arm, a.model, a.data, completion=a.completion, steps=a.steps, dpo=a.dpo)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = grpo_sides.prepare(a.folder or Path(tmp), max_seq_len=1280)
        if a.dpo is not None:
            from transformers import AutoTokenizer

            data = (a.folder or Path(tmp)) / f"pairs-{a.dpo}.jsonl"
            dpo_sides.write_pairs(data, AutoTokenizer.from_pretrained(model_dir), length=a.dpo, n=8 * (a.steps + 3))
        results: list[dict] = []
        for rep in range(a.repeats):
            for spec in (a.arms if rep % 2 == 0 else list(reversed(a.arms))):
                cmd = [sys.executable, __file__, "--arm", spec, "--model", str(model_dir), "--data", str(data),
                       "--completion", str(a.completion), "--steps", str(a.steps)] + \
                      (["--dpo", str(a.dpo)] if a.dpo is not None else [])
                env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1" if spec.endswith("+thp") else "0"}
                r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.splitlines()[-1])
                results.append(r)
                print(f"{spec} MiB: {r['s_per_step']:.3f} s/step (CPU {r['cpu_s_per_step']:.3f}), "
                      f"{r['faults_per_step']:,.0f} faults/step, {r['sys_ms_per_step']:.0f} ms system/step, peak per step "
                      f"{' → '.join(str(s['peak_mib']) for s in r['steps'])} MiB, at step end "
                      f"{' → '.join(str(s['end_rss_mib']) for s in r['steps'])}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
