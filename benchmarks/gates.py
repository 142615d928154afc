"""The quality gates on the arithmetic world's own splits: what each removes, and how long it takes.

    python benchmarks/gates.py [--n 2000] [--seed 0]

SFT chats and preference pairs from the world (a templated, short-text corpus: the hard case for
near-duplicate removal), decontaminated against every level's held-out eval prompts. Prints each gate's
report and seconds, and the O(N²) exact near-duplicate reference's time and whether it agrees with LSH.
"""

from __future__ import annotations

import argparse
import time

from posttrain.data.gates import decontaminate, eval_index, exact_dedup, format_filter, length_filter, near_dedup, near_dedup_exact
from posttrain.tasks.arithmetic import ArithmeticTask


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    task = ArithmeticTask(seed=args.seed)
    index = eval_index([(f"{lv}[{i}]", p) for lv in task.levels for i, p in enumerate(task.eval_problems(lv))])
    for kind in ("sft", "preference"):
        records = task.records(kind, args.n)
        print(f"== {kind}: {len(records)} records")
        kept = records
        for gate in (exact_dedup, near_dedup, lambda r: decontaminate(r, index), length_filter, format_filter):
            (kept, report), s = timed(gate, kept)
            print(f"  {report.summary()}  [{s:.2f} s]")
            for e in report.examples[:2]:
                print(f"    e.g. {e.where}: {e.detail} — {e.text[:70]}")
        exact_kept, _ = exact_dedup(records)
        (lsh_kept, lsh), s_lsh = timed(near_dedup, exact_kept)
        (ref_kept, ref), s_ref = timed(near_dedup_exact, exact_kept)
        missed = len({id(r) for r in lsh_kept} - {id(r) for r in ref_kept})
        print(f"  near_dedup LSH {s_lsh:.2f} s, removed {lsh.n_removed}; exact O(N²) {s_ref:.2f} s, removed {ref.n_removed}; "
              f"same records kept: {lsh_kept == ref_kept} (LSH kept {missed} the reference removes)")


if __name__ == "__main__":
    main()
