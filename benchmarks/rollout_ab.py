"""The native engine of this checkout against the same engine at another git revision (A/B).

    python benchmarks/rollout_ab.py a1e3f0c --dtype bf16 --batch 64 --model tiny-30m --pairs 3

On a shared or drifting machine two measurements minutes apart differ by more than most changes
to the engine, so this runs the two builds in alternating subprocesses (old, new, then new, old, …),
each one building the same tiny model from the same seed and timing `generate` on the same prompts
and sampling settings as `rollout.py` (temperature 1, 64 new tokens, one warm-up call dropped,
median tok/s of the rest). It prints both series and the new/old ratio of each pair; read the
median ratio. The other revision is checked out into a temporary `git worktree` and imported ahead
of this checkout's package (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, statistics, sys, time
import torch
sys.path.insert(0, sys.argv[5])                      # this checkout's benchmarks/: rollout.py's model and prompts
from rollout import DTYPES, bench_case, corpus
import posttrain
from posttrain.models import train_tokenizer
from posttrain.rollout import SamplingParams, make_engine
torch.set_num_threads(int(sys.argv[4]))
tok = train_tokenizer(corpus(), vocab_size=512)
model, prompts = bench_case(sys.argv[3], DTYPES[sys.argv[1]], int(sys.argv[2]), tok)
engine = make_engine("native", model, tok)
rates = []
for rep in range(6):
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64, seed=rep)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    if rep:                                          # rep 0 warms up (and builds the fused weights)
        rates.append(int(out.completion_mask.sum()) / seconds)
print(json.dumps({"tok_s": statistics.median(rates), "package": posttrain.__file__}))
"""


def measure(source: Path, args: argparse.Namespace) -> float:
    env = {**os.environ, "PYTHONPATH": str(source)}
    out = subprocess.run([sys.executable, "-c", CHILD, args.dtype, str(args.batch), args.model, str(args.threads),
                          str(ROOT / "benchmarks")], cwd=source, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the run from {source} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result["package"].startswith(str(source)):
        raise SystemExit(f"imported {result['package']}, not the build in {source}")
    return result["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("revision", help="the git revision to compare against (the 'old' side)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--model", default="tiny-30m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3, help="alternating (old, new) pairs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old_tree), args.revision],
                       check=True)
        try:
            series: dict[str, list[float]] = {"old": [], "new": []}
            for k in range(args.pairs):
                for side in ("old", "new") if k % 2 == 0 else ("new", "old"):
                    series[side].append(measure(old_tree if side == "old" else ROOT, args))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)], check=False)
    ratios = [b / a for a, b in zip(series["old"], series["new"])]
    print(f"native engine, {args.model} {args.dtype} batch {args.batch}, {args.threads} threads, 64 new tokens")
    print(f"  old ({args.revision}) tok/s: {', '.join(f'{x:,.0f}' for x in series['old'])}")
    print(f"  new (this checkout) tok/s: {', '.join(f'{x:,.0f}' for x in series['new'])}")
    print(f"  new/old per pair: {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
