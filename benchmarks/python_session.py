"""The Python tool's two modes: a session per episode (one interpreter, cells over a pipe) vs a fresh
sandboxed process per call — the cost of the first call, of each later call, and of a reset.

    python benchmarks/python_session.py                    # bubblewrap, 20 calls each
    python benchmarks/python_session.py --backend unsafe-subprocess --calls 50

Per mode: the first call (a session starts its interpreter; stateless, a process), then the median of
the next calls (`x = x + 1` — state in a session; a fresh program stateless), then, in the session, a
call that times out (0.5 s limit) and the call after it (a fresh interpreter). Medians in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

from posttrain.envs import PythonSessionTool, PythonTool
from posttrain.sandbox import Limits, open_sandbox
from posttrain.sandbox.session import SessionHost


def timed(tool, code: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    (r,) = tool.run([{"code": code}])
    return (time.perf_counter() - t0) * 1e3, r.content


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="bubblewrap")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    limits = Limits(timeout_s=5.0, memory_bytes=512 << 20, output_bytes=64 << 10, processes=8)

    host = SessionHost(args.backend, limits)
    host.backend()  # the backend's one-time probe, outside the timings
    session = PythonSessionTool(host)
    first, _ = timed(session, "x = 0")
    later = [timed(session, "x = x + 1\nprint(x)")[0] for _ in range(args.calls)]
    _, last = timed(session, "x")
    host.limits = Limits(timeout_s=0.5, memory_bytes=512 << 20, output_bytes=64 << 10, processes=8)
    hang, _ = timed(session, "while True:\n    pass")
    host.limits = limits
    after, _ = timed(session, "print(1)")
    session.close()
    host.close()

    with open_sandbox(args.backend, concurrency=1, limits=limits) as pool:
        stateless = PythonTool(limits=limits, pool=pool)
        s_first, _ = timed(stateless, "x = 0")
        s_later = [timed(stateless, "x = 1\nprint(x)")[0] for _ in range(args.calls)]

    print(f"backend {args.backend}, {args.calls} calls; ms")
    print(f"session:   first call {first:7.1f}   later calls (median) {statistics.median(later):6.1f}   "
          f"a 0.5 s timeout {hang:7.1f}   the call after it (fresh interpreter) {after:6.1f}   x after {args.calls} "
          f"increments: {last.strip()}")
    print(f"stateless: first call {s_first:7.1f}   later calls (median) {statistics.median(s_later):6.1f}")
    print(f"a later call, stateless / session: {statistics.median(s_later) / statistics.median(later):.0f}×")


if __name__ == "__main__":
    main()
