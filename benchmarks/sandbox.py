"""Sandbox throughput: trivial programs per second through the pool, against the issue's 20/s target.

    python benchmarks/sandbox.py [--n 200] [--concurrency 1 2 4] [--backend bubblewrap]

Each program is a one-line function with one test, so the number measures the sandbox's per-run
cost (bwrap set-up, interpreter start-up, the cgroup, the parent's reads and the judge), not the
program. Also prints the CPU seconds the runs cost per program (this process plus its reaped
children) and the machine's load average, since other jobs on a shared host change the wall time.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from posttrain.sandbox import Limits, Status, judge_programs, open_sandbox, parse_tests

TARGET_PER_S = 20.0


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="programs per measurement")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--backend", default="bubblewrap")
    args = ap.parse_args()

    tests = parse_tests(["assert add(1, 2) == 3"])
    programs = [(f"def add(a, b):\n    return a + b  # {i}", tests, "") for i in range(args.n)]
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} "
          f"(other jobs on this host share the CPU)")
    print(f"{'concurrency':>11} {'programs/s':>11} {'ms/program':>11} {'CPU ms/program':>15} "
          f"{'vs target':>10}")
    for c in args.concurrency:
        with open_sandbox(args.backend, concurrency=c, limits=Limits(timeout_s=10)) as pool:
            judge_programs(pool, programs[:c])  # warm-up: page cache, thread start
            cpu0, t0 = cpu_seconds(), time.perf_counter()
            verdicts = judge_programs(pool, programs)
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        bad = [v for v in verdicts if v.status is not Status.PASS]
        if bad:
            raise SystemExit(f"{len(bad)} trivial programs did not pass, e.g. {bad[0]}")
        rate = args.n / wall
        print(f"{c:>11} {rate:>11.1f} {1e3 * wall / args.n:>11.1f} {1e3 * cpu / args.n:>15.1f} "
              f"{rate / TARGET_PER_S:>9.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
