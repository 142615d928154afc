"""Math answer verifier: math-verify's own extraction and comparison, in killable worker processes.

Reference: Hugging Face ``math-verify`` (Kydlíček et al. 2025), as used for the accuracy reward of
DeepSeek-R1-style RLVR (DeepSeek-AI 2025, §2.2.2: "the model is required to provide the final
answer in a specified format (e.g. within a box), enabling reliable rule-based verification").
Each item is ``parse(gold)``, ``parse(answer)``, ``verify(gold, answer)`` with math-verify's
default extraction (LaTeX then plain expressions: the last ``\\boxed{}``, an "answer is …" span,
``$…$``/``\\(…\\)``/``\\[…\\]``/``$$…$$``, ``x = …`` forms, thousands separators, percent, units
and ``\\text`` wrappers stripped, sets and intervals) — gold first, since ``verify`` is not
symmetric. Score 1.0 = correct, 0.0 = wrong or no answer found.

Departures:
1. Hard, killable timeout. math-verify's own timeout uses ``signal.alarm``, which raises outside
   the main thread and cannot stop C-level work. Here each item runs in a worker *process*
   (``python -c …`` over pipes, so the caller's ``__main__`` is never re-imported) and the
   parent waits at most ``timeout_s``; a worker past its deadline is SIGKILLed and replaced, and
   the item is ``None`` with reason ``timeout``. math-verify's internal timeouts are disabled.
   A worker also runs under an address-space limit (``memory_limit_mb``).
2. The answer is looked for only in :func:`posttrain.rewards.format.answer_region` — after
   ``</think>`` when there is one; no answer when ``<think>`` is never closed or a second think
   tag follows — never in the reasoning. Inside that region extraction is math-verify's, lenient:
   a hedge ``38 or 39`` is graded as its last answer. The one-answer, no-trailing-junk rule is
   the ``format`` verifier's (combine both to pay for it).
3. A bare LaTeX gold (``\\frac{1}{3}``, ``2\\sqrt{3}``, ``\\{1,2\\}``, ``(-\\infty, 3]``: how datasets
   store golds) is parsed as ``\\boxed{gold}``, math-verify's most reliable extraction target —
   read as it is, ``2\\sqrt{3}`` would be the number 2. A gold with math delimiters or a box
   (``$\\frac{1}{3}$``, ``\\boxed{38}``, a whole reference solution), or one of plain digits,
   signs, separators, ``/`` and ``%`` (``19``, ``1,22``, ``-10/9``), is parsed as it is.
4. Exact-integer fast path, only where it is provably what math-verify returns: a bare integer
   gold (``-12``, no leading zeros) and an answer region that is one ASCII integer (``19``,
   ``007``, ``-3``, an optional final period). On such text math-verify's only matching pattern
   is its plain-number one, which yields ``int(text)``; its LaTeX patterns need a delimiter,
   ``\\frac`` or ``\\boxed``, its expression pattern an operator after the first digit, its
   answer patterns a word. ``+5`` and ``-007`` match none of them (math-verify finds no answer,
   so they score 0.0) and are left to it. Likewise an answer region without one ASCII digit for a
   number-literal gold scores 0.0 in-process: nothing math-verify could extract from it passes the
   literal guard (departure 5). A test compares both with math-verify.
5. ``literal_numbers=True`` (default): when the gold is a number literal (integer, decimal,
   fraction, percentage), the answer math-verify extracted must be one too — after its last
   ``=`` or ``\\approx``, so ``x = 5`` and ``12 + 7 = 19`` count as ``5`` and ``19`` — else 0.0.
   math-verify evaluates expressions, so ``12+7`` would "equal" a gold ``19``: a policy could
   restate the question and be paid for it. Symbolic golds (``2\\sqrt{3}``) are unaffected.
6. ``None`` (cannot judge) is returned for: a missing/blank gold or one math-verify cannot parse
   (``unjudgeable``), a timeout (``timeout``), an exception inside ``verify`` or a dead worker
   (``error``). An answer math-verify finds nothing in is the policy's fault: 0.0.
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
from posttrain.rewards.format import answer_region

# ---------------------------------------------------------------------------- literals

# ASCII digits only: Python's \d also matches '٣', which math-verify does not read as a number.
_GOLD_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_ANSWER_INT = re.compile(r"(?:[0-9]+|-0+|-[1-9][0-9]*)\.?")
_DIGITS = r"(?:[0-9]{1,3}(?:(?:,|\{,\}|\\,|,\\!)[0-9]{3})+|[0-9]+)"
_DECIMAL = rf"(?:{_DIGITS}(?:\.[0-9]+)?|\.[0-9]+)"
_FRAC = r"(?:\\[dtc]?frac\s*\{\s*[+-]?[0-9]+\s*\}\s*\{\s*[+-]?[0-9]+\s*\}|\\[dtc]?frac\s*[0-9]\s*[0-9])"
_NUMBER = re.compile(rf"[+-]?\s*(?:{_FRAC}|{_DIGITS}\s*/\s*{_DIGITS}|{_DECIMAL})\s*(?:\\?%)?")
_ASCII_DIGIT = re.compile(r"[0-9]")
_LAST_EQUALS = re.compile(r"(?:=|\\approx)")
# A gold of digits, signs, separators, '/' and '%' only: math-verify's plain-number reader takes it
# as written (`1,22` is 1.22, `1 000` is 1000); boxed, `1,22` would become the set {1, 22}.
_PLAIN_NUMBER_GOLD = re.compile(r"[0-9+\-.,/%\s]+")


def fast_integers(gold: str, region: str) -> tuple[int, int] | None:
    """(gold, answer) as ints when the fast path applies (departure 4), else None."""
    gold, region = gold.strip(), region.strip()
    if _GOLD_INT.fullmatch(gold) and _ANSWER_INT.fullmatch(region):
        return int(gold), int(region.rstrip("."))
    return None


def is_number_literal(text: str) -> bool:
    """Integer, decimal, fraction (``3/4``, ``\\frac{3}{4}``) or percentage, optionally signed."""
    return _NUMBER.fullmatch(text.strip()) is not None


def final_value(text: str) -> str:
    """What an extracted answer states last, outer parentheses dropped: ``k = \\frac{1}{3}`` →
    ``\\frac{1}{3}``; ``12+7=19`` → ``19``; ``( \\frac{1}{3} )`` (from ``\\left( … \\right)``) → ``\\frac{1}{3}``."""
    value = _LAST_EQUALS.split(text)[-1].strip()
    while value.startswith("(") and value.endswith(")") and "(" not in value[1:-1] and ")" not in value[1:-1]:
        value = value[1:-1].strip()
    return value


def gold_text(gold: object) -> str | None:
    """The gold answer as math-verify should read it (departure 3), or None when there is none."""
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
    if _PLAIN_NUMBER_GOLD.fullmatch(text) or any(m in text for m in ("\\boxed", "$", "\\(", "\\[")):
        return text
    return f"\\boxed{{{text}}}"


# ---------------------------------------------------------------------------- worker side

_READY = "ready"


def _judge(parse: Any, verify: Any, gold_cache: dict[str, list[Any]], gold: str, region: str,
           literal_numbers: bool) -> list[str]:
    """One item, inside a worker: ``[outcome, detail]``, outcome ∈ correct | wrong | unjudgeable."""
    if gold not in gold_cache:
        try:
            gold_cache[gold] = parse(gold, parsing_timeout=None, raise_on_error=True)
        except Exception as exc:  # noqa: BLE001 — an unparseable gold cannot be judged
            return ["unjudgeable", f"gold {gold!r} did not parse: {type(exc).__name__}"]
    parsed_gold = gold_cache[gold]
    if not parsed_gold:
        return ["unjudgeable", f"gold {gold!r} did not parse"]
    try:
        parsed_pred = parse(region, parsing_timeout=None, raise_on_error=True)
    except Exception:  # noqa: BLE001 — the policy's answer is not math: wrong, not an error
        return ["wrong", "no answer found"]
    if not parsed_pred:
        return ["wrong", "no answer found"]
    if literal_numbers:
        # parse() returns [value, extracted text]: the text is what the guard reads (departure 5).
        gold_str, pred_str = parsed_gold[-1], parsed_pred[-1]
        if (isinstance(gold_str, str) and is_number_literal(gold_str)
                and not (isinstance(pred_str, str) and is_number_literal(final_value(pred_str)))):
            return ["wrong", f"answer {pred_str!r} is not a number literal"]
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
    """Entry point of a worker process: JSON lines ``[gold, region, literal_numbers]`` in,
    ``[outcome, detail]`` out."""
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
        gold, region, literal_numbers = json.loads(line)
        try:
            result = _judge(parse, verify, gold_cache, gold, region, literal_numbers)
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

    def send(self, gold: str, region: str, literal_numbers: bool) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps([gold, region, literal_numbers]) + "\n").encode())
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

    def run(self, tasks: Sequence[tuple[str, str, bool]], timeout_s: float) -> list[list[str]]:
        """``[outcome, detail]`` per task; outcome ∈ correct | wrong | unjudgeable | error | timeout."""
        try:
            return self._run(tasks, timeout_s)
        except BaseException:
            _shutdown(self.workers)  # no half-assigned worker survives into the next call
            raise

    def _run(self, tasks: Sequence[tuple[str, str, bool]], timeout_s: float) -> list[list[str]]:
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
    path: ``in_process``), without an answer region (``no_answer``), sent to math-verify (``pooled``),
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

    def __call__(self, completions: Sequence[str], *, answer: Sequence[Any], **_: Any) -> Scores:
        check_columns("math", completions, answer=answer)
        with self._lock:
            return self._score(completions, answer)

    def _score(self, completions: Sequence[str], answer: Sequence[Any]) -> Scores:
        values: list[float | None] = [None] * len(completions)
        reasons: list[Skip | None] = [None] * len(completions)
        jobs: list[tuple[int, str, str]] = []
        for i, (completion, raw_gold) in enumerate(zip(completions, answer)):
            gold = gold_text(raw_gold)
            if gold is None:
                reasons[i] = Skip.UNJUDGEABLE
                continue
            region = answer_region(completion)
            if region is None or not region.strip():
                self.counters["no_answer"] += 1
                values[i] = 0.0
                continue
            bare_gold = str(raw_gold).strip()
            ints = fast_integers(bare_gold, region) if self.integer_fast_path else None
            if ints is not None:
                self.counters["in_process"] += 1
                values[i] = 1.0 if ints[0] == ints[1] else 0.0
            elif self.literal_numbers and self.integer_fast_path and is_number_literal(bare_gold) and not _ASCII_DIGIT.search(region):
                # A number gold and not one digit in the region: whatever math-verify extracts is no
                # number literal, so the guard scores it 0.0 — decided here, without the worker.
                self.counters["in_process"] += 1
                values[i] = 0.0
            else:
                jobs.append((i, gold, region))
        if jobs:
            outcomes = self._pool.run([(g, r, self.literal_numbers) for _, g, r in jobs], self.timeout_s)
            self.counters["pooled"] += len(jobs)
            for (i, _, _), (outcome, _detail) in zip(jobs, outcomes):
                if outcome in ("correct", "wrong"):
                    values[i] = 1.0 if outcome == "correct" else 0.0
                else:
                    reasons[i] = {"timeout": Skip.TIMEOUT, "unjudgeable": Skip.UNJUDGEABLE}.get(
                        outcome, Skip.ERROR
                    )
        return Scores(values, reasons)
