"""Math answer verifier: math-verify in killable worker processes, with an exact-integer fast path.

Reference: Hugging Face ``math-verify`` (Kydlíček et al. 2025), as used for the accuracy reward of
DeepSeek-R1-style RLVR (DeepSeek-AI 2025, §2.2.2: "the model is required to provide the final
answer in a specified format (e.g. within a box), enabling reliable rule-based verification").
Each item is ``parse(gold)`` first, then ``parse(pred)``, then ``verify(gold, pred)`` — in that
order, because ``verify`` is not symmetric. Score 1.0 = correct, 0.0 = wrong or no answer.

Departures:
1. Hard, killable timeout. math-verify's own timeout uses ``signal.alarm``, which raises outside
   the main thread and cannot stop C-level work. Here each item runs in a worker *process*
   (``python -c …`` over pipes, so the caller's ``__main__`` is never re-imported) and the
   parent waits at most ``timeout_s``; a worker past its deadline is SIGKILLed and replaced, and
   the item is ``None`` with reason ``timeout``. math-verify's internal timeouts are disabled.
   A worker also runs under an address-space limit (``memory_limit_mb``).
2. The answer is only the one :func:`posttrain.rewards.format.final_answer` finds after
   ``</think>`` (a ``\\boxed{}`` or the bare answer span), never a number from the reasoning; a
   missing, doubled or junk-trailed answer scores 0.0. Both gold and answer go to math-verify
   wrapped in ``\\boxed{…}`` (its most reliable extraction target; measured ~0.4 ms per parse).
3. Exact-integer fast path: when the gold answer and the extracted answer are both integers
   (``-12``, ``1,234``), they are compared in-process with ``int`` — no worker round trip. This is
   the whole arithmetic world; anything else goes to math-verify.
4. ``literal_numbers=True`` (default): when the gold answer is a number literal (integer, decimal,
   fraction, percentage), the answer must be one too, else it scores 0.0 without calling
   math-verify. math-verify evaluates expressions, so ``12+7`` would "equal" a gold ``19`` — a
   policy could restate the question and be paid for it. Symbolic golds (``2\\sqrt{3}``) are
   unaffected.
5. ``None`` (cannot judge) is returned for: a missing/blank gold or one math-verify cannot parse
   (``unjudgeable``), a timeout (``timeout``), an exception inside ``verify`` or a dead worker
   (``error``). An answer math-verify cannot parse is the policy's fault: 0.0.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.rewards.base import Scores, Skip, VerifierInputError, check_columns
from posttrain.rewards.format import extract_answer, final_answer

# ---------------------------------------------------------------------------- literals

_INT = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)")
_DIGITS = r"(?:\d{1,3}(?:(?:,|\{,\}|\\,)\d{3})+|\d+)"
_DECIMAL = rf"(?:{_DIGITS}(?:\.\d+)?|\.\d+)"
_FRAC = r"(?:\\[dt]?frac\s*\{\s*[+-]?\d+\s*\}\s*\{\s*[+-]?\d+\s*\}|\\[dt]?frac\s*\d\s*\d)"
_NUMBER = re.compile(rf"[+-]?\s*(?:{_FRAC}|{_DIGITS}\s*/\s*{_DIGITS}|{_DECIMAL})\s*(?:\\?%)?")


def as_integer(text: str) -> int | None:
    """``"-1,234"`` → -1234; ``None`` for anything that is not a plain integer literal."""
    text = text.strip()
    return int(text.replace(",", "")) if _INT.fullmatch(text) else None


def is_number_literal(text: str) -> bool:
    """Integer, decimal, fraction (``3/4``, ``\\frac{3}{4}``) or percentage, optionally signed."""
    return _NUMBER.fullmatch(text.strip()) is not None


def normalize_gold(gold: object) -> str | None:
    """The gold answer as a bare expression (``$\\frac12$`` / ``\\boxed{38}`` → inner), or None."""
    if gold is None or isinstance(gold, bool):
        return None
    if isinstance(gold, int):
        return str(gold)
    if not isinstance(gold, str):
        raise VerifierInputError(
            f"math: gold answer {gold!r} has type {type(gold).__name__}; expected str or int"
        )
    text = gold.strip()
    if not text:
        return None
    if "\\boxed" in text or "$" in text or text.startswith(("\\(", "\\[")):
        return extract_answer(text)  # same box/delimiter rules as the policy's answers
    return text


# ---------------------------------------------------------------------------- worker side

_READY = "ready"


def _judge(parse: Any, verify: Any, gold_cache: dict[str, list[Any]], gold: str, pred: str) -> list[str]:
    """One item, inside a worker: ``[outcome, detail]``, outcome ∈ correct | wrong | unjudgeable."""
    if gold not in gold_cache:
        try:
            gold_cache[gold] = parse(f"\\boxed{{{gold}}}", parsing_timeout=None, raise_on_error=True)
        except Exception as exc:  # noqa: BLE001 — an unparseable gold cannot be judged
            return ["unjudgeable", f"gold {gold!r} did not parse: {type(exc).__name__}"]
    parsed_gold = gold_cache[gold]
    if not parsed_gold:
        return ["unjudgeable", f"gold {gold!r} did not parse"]
    try:
        parsed_pred = parse(f"\\boxed{{{pred}}}", parsing_timeout=None, raise_on_error=True)
    except Exception:  # noqa: BLE001 — the policy's answer is not math: wrong, not an error
        return ["wrong", "answer did not parse"]
    if not parsed_pred:
        return ["wrong", "answer did not parse"]
    ok = verify(parsed_gold, parsed_pred, timeout_seconds=None, raise_on_error=True)  # gold first
    return ["correct" if ok else "wrong", ""]


def _die_with_parent(parent_pid: int | None) -> None:
    """Linux: SIGKILL this worker when the parent dies, so a hung parse never outlives a killed run.

    (Elsewhere an orphan exits at its next read of the closed stdin, i.e. after the item it is on.)
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)  # the parent died before prctl took effect


def _worker_main(argv: list[str]) -> None:
    """Entry point of a worker process: JSON lines ``[gold, pred]`` in, ``[outcome, detail]`` out."""
    memory_limit_mb = int(argv[0]) if argv else 0
    parent_pid = int(argv[1]) if len(argv) > 1 else None
    _die_with_parent(parent_pid)
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")  # private channel: nothing else writes here
    os.dup2(2, 1)  # stray prints from sympy & co. go to stderr, not into the protocol
    if memory_limit_mb > 0:
        import resource

        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        import logging

        from math_verify import parse, verify

        logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # "timeout disabled": we kill instead
    except Exception as exc:  # noqa: BLE001
        proto.write(json.dumps(["fatal", f"cannot import math_verify: {type(exc).__name__}: {exc}"]) + "\n")
        proto.flush()
        return
    gold_cache: dict[str, list[Any]] = {}
    proto.write(json.dumps([_READY, ""]) + "\n")
    proto.flush()
    for line in sys.stdin:
        gold, pred = json.loads(line)
        try:
            result = _judge(parse, verify, gold_cache, gold, pred)
        except Exception as exc:  # noqa: BLE001 — reported to the parent as a verifier error
            result = ["error", f"{type(exc).__name__}: {str(exc)[:200]}"]
        proto.write(json.dumps(result) + "\n")
        proto.flush()


# ---------------------------------------------------------------------------- parent side

_BOOT = "import sys; from posttrain.rewards.math_verifier import _worker_main; _worker_main(sys.argv[1:])"


class _Worker:
    def __init__(self, memory_limit_mb: int, startup_timeout_s: float):
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])  # the folder holding posttrain/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(memory_limit_mb), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self.fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        self.buffer = b""
        self.ready = False
        self.ready_deadline = time.monotonic() + startup_timeout_s
        self.job: int | None = None
        self.deadline = float("inf")

    def send(self, gold: str, pred: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps([gold, pred]) + "\n").encode())
        self.proc.stdin.flush()

    def read_lines(self) -> list[str] | None:
        """Lines available now; None at end of file (the worker died)."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [line.decode() for line in lines]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def _shutdown(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()
    workers.clear()


class _WorkerPool:
    """``size`` worker processes, one item each at a time, every item under a hard deadline."""

    def __init__(self, size: int, memory_limit_mb: int, startup_timeout_s: float, counters: Counter[str]):
        self.size, self.memory_limit_mb, self.startup_timeout_s = size, memory_limit_mb, startup_timeout_s
        self.counters = counters
        self.workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self.workers)

    def _spawn(self, selector: selectors.BaseSelector | None = None) -> _Worker:
        worker = _Worker(self.memory_limit_mb, self.startup_timeout_s)
        self.workers.append(worker)
        if selector is not None:
            selector.register(worker.fd, selectors.EVENT_READ, worker)
        return worker

    def _replace(self, worker: _Worker, selector: selectors.BaseSelector) -> None:
        selector.unregister(worker.fd)
        worker.kill()
        self.workers.remove(worker)
        self.counters["restarts"] += 1
        self._spawn(selector)

    def close(self) -> None:
        self._finalizer()

    def run(self, tasks: Sequence[tuple[str, str]], timeout_s: float) -> list[list[str]]:
        """``[outcome, detail]`` per task; outcome ∈ correct | wrong | unjudgeable | error | timeout."""
        try:
            return self._run(tasks, timeout_s)
        except BaseException:
            _shutdown(self.workers)  # no half-assigned worker survives into the next call
            raise

    def _run(self, tasks: Sequence[tuple[str, str]], timeout_s: float) -> list[list[str]]:
        results: list[list[str] | None] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        while len(self.workers) < self.size:
            self._spawn()
        with selectors.DefaultSelector() as selector:
            for worker in self.workers:
                selector.register(worker.fd, selectors.EVENT_READ, worker)
            while queue or any(w.job is not None for w in self.workers):
                now = time.monotonic()
                for worker in list(self.workers):
                    if worker.ready and worker.job is None and queue:
                        job = queue.popleft()
                        try:
                            worker.send(*tasks[job])
                        except (BrokenPipeError, OSError):
                            results[job] = ["error", "worker pipe closed"]
                            self._replace(worker, selector)
                            continue
                        worker.job, worker.deadline = job, now + timeout_s
                waits = [w.deadline if w.ready else w.ready_deadline for w in self.workers]
                for key, _ in selector.select(timeout=max(0.0, min(waits) - time.monotonic())):
                    worker = key.data
                    lines = worker.read_lines()
                    if lines is None:  # end of file: the worker died (memory limit, crash)
                        if worker.job is not None:
                            results[worker.job] = ["error", f"worker exited with code {worker.proc.wait()}"]
                        elif not worker.ready:
                            raise RuntimeError(
                                f"math verifier worker exited with code {worker.proc.wait()} at startup"
                            )
                        self._replace(worker, selector)
                        continue
                    for line in lines:
                        outcome, detail = json.loads(line)
                        if outcome == "fatal":
                            raise RuntimeError(f"math verifier worker failed to start: {detail}")
                        if outcome == _READY:
                            worker.ready = True
                        elif worker.job is not None:
                            results[worker.job] = [outcome, detail]
                            worker.job, worker.deadline = None, float("inf")
                now = time.monotonic()
                for worker in list(self.workers):
                    if worker.job is not None and now >= worker.deadline:
                        results[worker.job] = ["timeout", f"no verdict within {timeout_s} s"]
                        self.counters["timeouts"] += 1
                        self._replace(worker, selector)  # SIGKILL: the only stop a hung parser obeys
                    elif not worker.ready and now >= worker.ready_deadline:
                        raise RuntimeError(
                            f"math verifier worker did not start within {self.startup_timeout_s} s"
                        )
        return [r if r is not None else ["error", "no result"] for r in results]


class MathVerifier:
    """Batched math accuracy: ``verifier(completions, answer=[gold, …]) -> Scores`` (1.0 / 0.0 / None).

    Holds worker processes: reuse one instance for a whole run and ``close()`` it (or use ``with``).
    Thread-safe (calls are serialized). ``counters`` counts items decided in-process (integer fast
    path, non-literal answer to a number), without an answer, sent to math-verify (``pooled``),
    timeouts and worker restarts over the instance's life. Worker start-up costs ~0.5–1.5 s, paid
    on first use of math-verify and after each timeout; integer-only batches never start a worker.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 3.0,
        workers: int = 1,
        literal_numbers: bool = True,
        integer_fast_path: bool = True,
        memory_limit_mb: int = 4096,
        startup_timeout_s: float = 60.0,
    ):
        if not (timeout_s > 0):
            raise VerifierInputError(f"math: timeout_s must be > 0 seconds, got {timeout_s!r}")
        if not (isinstance(workers, int) and workers >= 1):
            raise VerifierInputError(f"math: workers must be an int >= 1, got {workers!r}")
        if not (isinstance(memory_limit_mb, int) and memory_limit_mb >= 0):
            raise VerifierInputError(
                f"math: memory_limit_mb must be an int >= 0 (0 = no limit), got {memory_limit_mb!r}"
            )
        self.timeout_s = float(timeout_s)
        self.literal_numbers = literal_numbers
        self.integer_fast_path = integer_fast_path  # False sends integers to math-verify too (tests)
        self.counters: Counter[str] = Counter()
        self._pool = _WorkerPool(workers, memory_limit_mb, startup_timeout_s, self.counters)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Kill the worker processes (a later call starts new ones)."""
        self._pool.close()
        self._pool = _WorkerPool(
            self._pool.size, self._pool.memory_limit_mb, self._pool.startup_timeout_s, self.counters
        )

    def __enter__(self) -> MathVerifier:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fast(self, gold: str, pred: str) -> float | None:
        """Verdict without math-verify, or None to ask it."""
        gold_int, pred_int = as_integer(gold), as_integer(pred)
        if self.integer_fast_path and gold_int is not None and pred_int is not None:
            return 1.0 if gold_int == pred_int else 0.0
        if self.literal_numbers and is_number_literal(gold) and not is_number_literal(pred):
            return 0.0
        return None

    def __call__(self, completions: Sequence[str], *, answer: Sequence[Any], **_: Any) -> Scores:
        check_columns("math", completions, answer=answer)
        with self._lock:
            return self._score(completions, answer)

    def _score(self, completions: Sequence[str], answer: Sequence[Any]) -> Scores:
        values: list[float | None] = [None] * len(completions)
        reasons: list[Skip | None] = [None] * len(completions)
        jobs: list[tuple[int, str, str]] = []
        for i, (completion, raw_gold) in enumerate(zip(completions, answer)):
            gold = normalize_gold(raw_gold)
            if gold is None:
                reasons[i] = Skip.UNJUDGEABLE
                continue
            pred = final_answer(completion)
            if pred is None:
                self.counters["no_answer"] += 1
                values[i] = 0.0
                continue
            fast = self._fast(gold, pred)
            if fast is not None:
                self.counters["in_process"] += 1
                values[i] = fast
            else:
                jobs.append((i, gold, pred))
        if jobs:
            outcomes = self._pool.run([(g, p) for _, g, p in jobs], self.timeout_s)
            self.counters["pooled"] += len(jobs)
            for (i, _, _), (outcome, _detail) in zip(jobs, outcomes):
                if outcome in ("correct", "wrong"):
                    values[i] = 1.0 if outcome == "correct" else 0.0
                else:
                    reasons[i] = {"timeout": Skip.TIMEOUT, "unjudgeable": Skip.UNJUDGEABLE}.get(
                        outcome, Skip.ERROR
                    )
        return Scores(values, reasons)
