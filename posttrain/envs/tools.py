"""Built-in tools and the executor that runs a turn's calls with caps on size and time.

A tool is `name`, a one-line `description` (what the system prompt tells the model) and
`run(calls) -> results`: batched, because the Python tool runs a turn's programs side by side in the
sandbox pool. A tool never raises on the model's input; what went wrong comes back as a `ToolResult`
with `error=True` and a message the model reads.

- `Calculator`: one arithmetic expression, evaluated by walking its AST (no `eval`): integers and
  floats, + − × / // % ** and unary ±; exponents up to 64 and results up to 10^100 in size, so
  `9**9**9` is an error message, not a minute of CPU.
- `PythonTool`: a program run in `posttrain.sandbox` (bubblewrap: no network, no host files, a
  wall-clock kill from outside, output caps — docs/sandbox.md); stateless (a fresh process per call).
  Its result is the program's stdout, then the error it raised, if any.

Every result is cut to `max_chars` characters (the sandbox already stops reading a stream at
`Limits.output_bytes`), with a note saying so, and marked as an error when it was cut.
"""

from __future__ import annotations

import ast
import math
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from posttrain.envs.tool_calls import CallError, ParsedTurn, ToolCall
from posttrain.sandbox import Job, Limits, SandboxPool, open_sandbox
from posttrain.sandbox.execution import probe_count
from posttrain.sandbox.session import Session, SessionHost

MAX_RESULT_CHARS = 2000  # what one tool result may put into the chat (tokens the model must attend to)


@dataclass(frozen=True)
class ToolResult:
    content: str
    error: bool = False  # the call failed: bad arguments, an exception, a timeout, a capped result
    probes: int = 0      # the program's attempts to read what it was not given (the sandbox's audit hook)


class Tool(Protocol):
    name: str
    description: str

    def run(self, calls: Sequence[dict[str, Any]]) -> list[ToolResult]:
        """One result per call's `arguments`, in order. Never raises on the model's input."""
        ...


def cap(result: ToolResult, max_chars: int = MAX_RESULT_CHARS) -> ToolResult:
    """`result` cut to `max_chars` characters, with a note; a cut result counts as an error."""
    if len(result.content) <= max_chars:
        return result
    return ToolResult(result.content[:max_chars] + f"\n[truncated: {len(result.content)} characters, "
                      f"limit {max_chars}]", error=True, probes=result.probes)


# ---- calculator ----------------------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**100
MAX_EXPRESSION_CHARS = 200


class CalculatorError(ValueError):
    pass


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError (with the reason) for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("not an arithmetic expression") from None
    try:
        return _value(tree.body)
    except RecursionError:  # "((((…" deep enough to exhaust the walk
        raise CalculatorError("expression nested too deeply") from None


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            out = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except (OverflowError, ValueError) as e:
            raise CalculatorError(str(e)) from None
        if isinstance(out, complex):  # (-8) ** 0.5
            raise CalculatorError("the result is not a real number")
        return _checked(out)
    raise CalculatorError(f"unsupported element {type(node).__name__!r} (numbers and + - * / // % ** only)")


def _checked(x: int | float) -> int | float:
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("the result is not finite")
    if abs(x) > MAX_MAGNITUDE:
        raise CalculatorError("the result is larger than 10^100")
    return x


class Calculator:
    name = "calculator"
    description = 'evaluates one arithmetic expression: {"expression": "12 * (3 + 4)"}'

    def run(self, calls: Sequence[dict[str, Any]]) -> list[ToolResult]:
        return [self._one(args) for args in calls]

    @staticmethod
    def _one(args: dict[str, Any]) -> ToolResult:
        expression = args.get("expression")
        if not isinstance(expression, str) or set(args) != {"expression"}:
            return ToolResult('error: calculator takes exactly {"expression": "<arithmetic>"}', error=True)
        try:
            value = calculate(expression)
        except CalculatorError as e:
            return ToolResult(f"error: {e}", error=True)
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)  # 10 / 2 → 5: the world's answers are integers
        return ToolResult(str(value))


# ---- python, in the sandbox ----------------------------------------------------------------------
DEFAULT_PYTHON_LIMITS = Limits(timeout_s=5.0, memory_bytes=512 << 20, output_bytes=64 << 10, processes=8)


class PythonTool:
    """Runs `{"code": ...}` as a stdin-less program in a sandbox pool (opened on first use; `close()` it).
    Stateless: each call is a fresh process; nothing persists between calls or episodes."""

    name = "python"
    description = 'runs a Python program and returns what it prints: {"code": "print(2 ** 10)"}'

    def __init__(self, *, limits: Limits = DEFAULT_PYTHON_LIMITS, backend: str = "bubblewrap",
                 concurrency: int | None = None, pool: SandboxPool | None = None):
        self.limits, self.backend, self.concurrency = limits, backend, concurrency
        self._pool, self._owned = pool, pool is None
        self._lock = threading.Lock()  # episodes step in threads: open the pool once

    def run(self, calls: Sequence[dict[str, Any]]) -> list[ToolResult]:
        out: list[ToolResult | None] = [None] * len(calls)
        jobs, where = [], []
        for i, args in enumerate(calls):
            code = args.get("code")
            if not isinstance(code, str) or set(args) != {"code"}:
                out[i] = ToolResult('error: python takes exactly {"code": "<program>"}', error=True)
            else:
                jobs.append(Job(code, audit=True))
                where.append(i)
        if jobs:
            with self._lock:
                if self._pool is None:
                    self._pool = open_sandbox(self.backend, concurrency=self.concurrency, limits=self.limits)
            for i, ex in zip(where, self._pool.run_many(jobs, self.limits)):
                out[i] = self._result(ex)
        return [r for r in out if r is not None]

    def _result(self, ex: Any) -> ToolResult:
        r = self._outcome(ex)
        return ToolResult(r.content, r.error, probes=probe_count(ex.records))

    def _outcome(self, ex: Any) -> ToolResult:
        stdout = ex.stdout.decode("utf-8", errors="replace")
        if not ex.started:
            return ToolResult(f"error: the sandbox failed to run the program ({ex.error or 'no start'})", error=True)
        if ex.output_exceeded:
            return ToolResult(stdout + f"\nerror: output over the {self.limits.output_bytes}-byte limit; "
                              "the program was stopped", error=True)
        finished = any(r.get("done") is True for r in ex.records)
        if ex.timed_out and not finished:
            return ToolResult(stdout + f"\nerror: timed out after {self.limits.timeout_s:g} s", error=True)
        if any("memory" in r for r in ex.records):
            return ToolResult(stdout + "\nerror: MemoryError (memory limit)", error=True)
        errors = [str(r["error"]) for r in ex.records if "error" in r]
        if errors:
            return ToolResult(stdout + f"\nerror: {errors[0][:500]}", error=True)
        exits = [r["exit"] for r in ex.records if "exit" in r]
        if any(e != 0 for e in exits):
            return ToolResult(stdout + f"\nerror: exit status {exits[0]}", error=True)
        return ToolResult(stdout)

    def close(self) -> None:
        if self._pool is not None and self._owned:
            self._pool.close()
            self._pool = None


class PythonSessionTool:
    """`python` with a session: one sandboxed interpreter per episode (`posttrain.sandbox.session`),
    so variables and definitions persist across calls like a notebook's cells; a cell whose last
    statement is an expression prints its value. A cell past the timeout (or the output cap) kills
    the interpreter: the model is told the session was reset, and it counts as an error. One instance
    per episode (the environment makes it); `close()` ends the interpreter."""

    name = "python"
    description = ('runs Python in a session kept for this episode (variables persist between calls) and '
                   'returns what it prints: {"code": "x = 2 ** 10\nprint(x)"}')

    def __init__(self, host: SessionHost):
        self.session: Session = host.open()

    def run(self, calls: Sequence[dict[str, Any]]) -> list[ToolResult]:
        out = []
        for args in calls:  # one after another: a cell may use what the one before defined
            code = args.get("code")
            if not isinstance(code, str) or set(args) != {"code"}:
                out.append(ToolResult('error: python takes exactly {"code": "<program>"}', error=True))
                continue
            r = self.session.run(code)
            text = r.stdout + (f"\nerror: {r.error}" if r.error else "")
            out.append(ToolResult(text, error=r.error is not None, probes=r.probes))
        return out

    def close(self) -> None:
        self.session.close()


BUILTIN_TOOLS = {"calculator": Calculator, "python": PythonTool}


# ---- a turn's calls ------------------------------------------------------------------------------
def run_calls(parsed: ParsedTurn, tools: dict[str, Tool], *, max_chars: int = MAX_RESULT_CHARS) -> list[ToolResult]:
    """One capped result per parsed item, in order: parse errors and unknown tools become error
    results; the calls of one tool run as one batch (the Python tool's programs side by side)."""
    out: list[ToolResult | None] = [None] * len(parsed.items)
    batches: dict[str, list[int]] = {}
    for i, item in enumerate(parsed.items):
        if isinstance(item, CallError):
            out[i] = ToolResult(item.message, error=True)
        elif item.name not in tools:
            out[i] = ToolResult(f"error: unknown tool {item.name[:60]!r}; available: {', '.join(sorted(tools))}",
                                error=True)
        else:
            batches.setdefault(item.name, []).append(i)
    for name, rows in batches.items():
        calls: list[ToolCall] = [parsed.items[i] for i in rows]  # type: ignore[misc]
        try:
            results = tools[name].run([c.arguments for c in calls])
            if len(results) != len(rows):
                raise RuntimeError(f"{len(results)} results for {len(rows)} calls")
        except Exception as e:  # a tool's own bug must not end the run: the model is told, it is counted
            results = [ToolResult(f"error: tool {name!r} failed: {type(e).__name__}", error=True)] * len(rows)
        for i, r in zip(rows, results):
            out[i] = r
    return [cap(r, max_chars) for r in out]  # type: ignore[arg-type]
