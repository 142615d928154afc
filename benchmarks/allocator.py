"""The host allocator's mmap threshold (`mmap_threshold_mib`, posttrain/runtime/allocator.py): time, page
faults and memory of our GRPO step at each setting, in one invocation.

    python benchmarks/allocator.py --completion 128 --steps 4 --arms 4 32
    python benchmarks/allocator.py --completion 512 --steps 4 --arms 4 32 --repeats 2

tiny-30m random init, bf16, the GRPO shape of `benchmarks/scaling.py` (2 prompts × G 8, T 1, μ 1), one
thread. Each arm runs in its own subprocess (the allocator is process-wide), the arms' order alternating
between repeats. Per arm: seconds per step (median after the first), process CPU seconds per step, minor
page faults per step, and for every step the resident set's high-water mark during the step and the
resident set at its end (`VmHWM` reset at each step's end through /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _vs_trl_grpo as grpo_sides  # noqa: E402


def _status_mib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:")) // 1024


def arm(mib: float, model_dir: Path, data: Path, *, completion: int, steps: int) -> dict:
    per_step: list[dict] = []
    faults = [resource.getrusage(resource.RUSAGE_SELF).ru_minflt]

    def on_step(r: dict) -> None:
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        per_step.append({"peak_mib": _status_mib("VmHWM"), "end_rss_mib": _status_mib("VmRSS"),
                         "completion_mean": r.get("response/length_mean")})
        Path("/proc/self/clear_refs").write_text("5")  # the next step's high-water mark is its own

    out = grpo_sides.run_ours(model_dir, data, steps, 1, bf16=True, completion=completion,
                              mmap_threshold_mib=mib, on_step=on_step)
    step_faults = [b - a for a, b in zip(faults[1:], faults[2:])]
    return {"mmap_threshold_mib": mib, "s_per_step": out["s_per_step"], "cpu_s_per_step": out["cpu_s_per_step"],
            "faults_per_step": statistics.median(step_faults), "steps": per_step,
            "rollout_s": out["rollout_s"], "rest_s": out["rest_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="measured steps after the warm-up")
    ap.add_argument("--arms", type=float, nargs="+", default=[4, 32], help="thresholds in MiB")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--arm", type=float, help="run one arm in this process (the driver's subprocess)")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--folder", type=Path, help="where the shared model and problems are built (default: a temp dir)")
    a = ap.parse_args()
    if a.arm is not None:
        print(json.dumps(arm(a.arm, a.model, a.data, completion=a.completion, steps=a.steps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = grpo_sides.prepare(a.folder or Path(tmp), max_seq_len=1280)
        results: list[dict] = []
        for rep in range(a.repeats):
            for mib in (a.arms if rep % 2 == 0 else list(reversed(a.arms))):
                cmd = [sys.executable, __file__, "--arm", str(mib), "--model", str(model_dir), "--data", str(data),
                       "--completion", str(a.completion), "--steps", str(a.steps)]
                r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
                results.append(r)
                print(f"{mib:g} MiB: {r['s_per_step']:.3f} s/step (CPU {r['cpu_s_per_step']:.3f}), "
                      f"{r['faults_per_step']:,.0f} faults/step, peak per step "
                      f"{' → '.join(str(s['peak_mib']) for s in r['steps'])} MiB, at step end "
                      f"{' → '.join(str(s['end_rss_mib']) for s in r['steps'])}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
