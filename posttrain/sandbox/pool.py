"""A pool that runs a batch of sandbox jobs in parallel, and the batch-level verdicts.

Threads, not processes: each job is a subprocess (bwrap) the thread only waits on, so the GIL is
not the bottleneck — process start-up is (about 15 ms of CPU per run with `python -S`).
One caveat shapes the design: `--die-with-parent` fires when the *thread* that started bwrap exits,
so the pool keeps its threads for its whole life and is closed only once no job is running.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from posttrain.sandbox.execution import Execution, Job, Limits
from posttrain.sandbox.judge import CallTest, IOTest, Status, Verdict, judge_calls, judge_stdio, parse_assert

BACKENDS = ("bubblewrap", "unsafe-subprocess")


class Backend(Protocol):
    name: str

    def run(self, job: Job, limits: Limits) -> Execution: ...


class SandboxPool:
    """Runs jobs on `backend`, at most `concurrency` at a time (default: the CPUs this process may
    use). Use as a context manager, or call `close()`."""

    def __init__(self, backend: Backend, *, concurrency: int | None = None,
                 limits: Limits | None = None) -> None:
        self.backend = backend
        self.limits = limits or Limits()
        if concurrency is None:
            affinity = getattr(os, "sched_getaffinity", None)
            concurrency = len(affinity(0)) if affinity else os.cpu_count() or 1
        self.concurrency = concurrency
        if self.concurrency < 1:
            raise ValueError(f"SandboxPool concurrency must be >= 1, got {self.concurrency}")
        self._executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix="sandbox")

    def run(self, job: Job, limits: Limits | None = None) -> Execution:
        return self.run_many([job], limits)[0]

    def run_many(self, jobs: Sequence[Job], limits: Limits | None = None) -> list[Execution]:
        if getattr(self.backend, "warn", None):  # the unsafe backend: every batch, loudly
            self.backend.warn()  # type: ignore[attr-defined]
        lim = limits or self.limits
        return list(self._executor.map(lambda j: self.backend.run(j, lim), jobs))

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_sandbox(backend: str = "bubblewrap", *, concurrency: int | None = None,
                 limits: Limits | None = None, python: str | None = None,
                 require_process_cap: bool = True) -> SandboxPool:
    """The entry point. `backend` is 'bubblewrap' (refuses to start, with the reason and the fix,
    where it cannot isolate) or 'unsafe-subprocess' (no isolation; warns on every batch)."""
    if backend == "bubblewrap":
        from posttrain.sandbox.bubblewrap import BubblewrapSandbox
        impl: Backend = BubblewrapSandbox(python, require_process_cap=require_process_cap)
    elif backend == "unsafe-subprocess":
        from posttrain.sandbox.unsafe import UnsafeSubprocessSandbox
        impl = UnsafeSubprocessSandbox(python)
    else:
        raise ValueError(f"sandbox backend {backend!r} is not one of {BACKENDS}")
    return SandboxPool(impl, concurrency=concurrency, limits=limits)


# ---- programs and their tests ------------------------------------------------------------------

Tests = Sequence[CallTest] | Sequence[IOTest]


def parse_tests(raw: Sequence[object], where: str = "tests") -> list[CallTest] | list[IOTest]:
    """A problem's tests as data arrives: assert strings (function tests), or {"stdin", "stdout"}
    dicts (I/O cases) — one kind per problem. Raises ValueError naming `where` and the item."""
    if not raw:
        raise ValueError(f"{where}: no tests given (a program with no tests would pass vacuously)")
    if all(isinstance(t, str) for t in raw):
        return [parse_assert(t) for t in raw]  # type: ignore[arg-type]
    if all(isinstance(t, IOTest) for t in raw):
        return list(raw)  # type: ignore[arg-type]
    if all(isinstance(t, CallTest) for t in raw):
        return list(raw)  # type: ignore[arg-type]
    cases = []
    for k, t in enumerate(raw):
        if not (isinstance(t, dict) and set(t) == {"stdin", "stdout"}
                and isinstance(t["stdin"], str) and isinstance(t["stdout"], str)):
            raise ValueError(f"{where}[{k}]: expected an assert string or a dict with exactly the "
                             f"str keys 'stdin' and 'stdout' (one kind per problem), got {t!r:.120}")
        cases.append(IOTest(t["stdin"], t["stdout"]))
    return cases


def judge_programs(pool: SandboxPool, programs: Sequence[tuple[str, Tests, str]],
                   limits: Limits | None = None) -> list[Verdict]:
    """Run every (code, tests, setup) and judge it. All jobs of the batch share the pool: a function-
    test program is one job; an I/O program is one job per case (fresh process per input)."""
    jobs: list[Job] = []
    spans: list[tuple[int, int]] = []
    for code, tests, setup in programs:
        first = len(jobs)
        if tests and isinstance(tests[0], CallTest):
            jobs.append(Job(code, calls=tuple(t.call for t in tests), setup=setup))  # type: ignore[union-attr]
        else:
            jobs.extend(Job(code, stdin=t.stdin) for t in tests)  # type: ignore[union-attr]
        spans.append((first, len(jobs)))
    executions = pool.run_many(jobs, limits)
    verdicts = []
    for (_, tests, _), (a, b) in zip(programs, spans, strict=True):
        if tests and isinstance(tests[0], CallTest):
            verdicts.append(judge_calls(executions[a], list(tests)))  # type: ignore[arg-type]
        else:
            cases = [judge_stdio(ex, t.stdout) for ex, t in zip(executions[a:b], tests, strict=True)]  # type: ignore[union-attr]
            verdicts.append(combine_cases(cases))
    return verdicts


def combine_cases(cases: list[Verdict]) -> Verdict:
    """All I/O cases of one program → one verdict. A definite failure (the candidate's doing) wins
    over a sandbox error: a wrong answer on case 2 is wrong whatever happened to case 3."""
    passed = sum(v.status is Status.PASS for v in cases)
    elapsed = max((v.elapsed_s for v in cases), default=0.0)
    for k, v in enumerate(cases):
        if v.status not in (Status.PASS, Status.SANDBOX_ERROR):
            return Verdict(v.status, passed, len(cases), f"case {k}: {v.detail}", elapsed)
    for k, v in enumerate(cases):
        if v.status is Status.SANDBOX_ERROR:
            return Verdict(v.status, passed, len(cases), f"case {k}: {v.detail}", elapsed)
    return Verdict(Status.PASS, passed, len(cases), "", elapsed)
