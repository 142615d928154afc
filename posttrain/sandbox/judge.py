"""Verdicts, decided in the trusted parent from what the sandbox returned.

Two problem kinds:
- function tests, MBPP / HumanEval style: `assert f(x) == y` is split here, in the parent, into a
  call `f(x)` — sent into the sandbox — and an expected value `y` — parsed with `ast.literal_eval`
  and kept here. The sandbox returns each call's value as tagged plain data; we rebuild it from the
  exact built-in types only and compare with `==` (or `math.isclose` where the assert said so);
- stdin → stdout programs: the whole output is compared with the expected output.

The candidate's exit code and anything it prints about itself can only veto a pass, never make one.

Departures from the harnesses this replaces (HumanEval's `check`, MBPP's exec of the asserts):
1. The asserts are never executed as written: only `assert <call> OP <literal>`,
   `assert <call>` / `assert not <call>`, and `assert math.isclose(<call>, <literal>, …)` are
   accepted (see `parse_assert`); anything else is a ValueError at parse time, naming the assert.
   Even truthiness is judged here, on the plain value.
2. Values cross back as plain data (None, bool, int, float, str, bytes, complex, list, tuple, dict,
   set, frozenset). An object with its own `__eq__`, or a subclass of a built-in, fails that test.
3. Output comparison ignores trailing whitespace at the end of each line and trailing blank lines,
   and `\\r\\n` vs `\\n` (what competitive-programming judges also forgive); any other byte counts.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from posttrain.sandbox.execution import Execution


class Status(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    RUNTIME_ERROR = "runtime_error"
    OUTPUT_LIMIT = "output_limit"
    SANDBOX_ERROR = "sandbox_error"  # the sandbox failed, not the candidate: reward None, never 0

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CallTest:
    """One function test: `call` runs in the sandbox; `op` and `expected` stay in the parent, where
    `value op expected` is evaluated on the decoded plain value."""

    call: str
    expected: Any
    op: str = "=="  # one of OPS
    rel_tol: float = 1e-9  # for op "isclose"
    abs_tol: float = 0.0
    source: str = ""  # the assert it came from, for messages

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"CallTest.op must be one of {sorted(OPS)}, got {self.op!r}")


OPS: dict[str, Any] = {
    "==": lambda v, e: v == e, "!=": lambda v, e: v != e,
    "<": lambda v, e: v < e, "<=": lambda v, e: v <= e,
    ">": lambda v, e: v > e, ">=": lambda v, e: v >= e,
    "in": lambda v, e: v in e, "not in": lambda v, e: v not in e,
    "is": lambda v, e: v is e, "is not": lambda v, e: v is not e,
    "truthy": lambda v, e: bool(v), "falsy": lambda v, e: not v,
    "isclose": None,  # handled in `matches` (needs the tolerances)
}
_AST_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
            ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
_MIRROR = {"==": "==", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}


@dataclass(frozen=True)
class IOTest:
    stdin: str
    stdout: str


@dataclass(frozen=True)
class Verdict:
    status: Status
    passed: int  # tests passed
    total: int
    detail: str = ""  # first failure, for logs; never fed back into the policy
    elapsed_s: float = 0.0

    @property
    def reward(self) -> float | None:
        """1.0 if every test passed, 0.0 otherwise, None if the sandbox could not judge."""
        if self.status is Status.SANDBOX_ERROR:
            return None
        return 1.0 if self.status is Status.PASS else 0.0


# ---- parsing tests (parent side) ------------------------------------------------------------------

def parse_assert(source: str) -> CallTest:
    """`assert f(1) == 2` → CallTest('f(1)', 2). Accepted shapes: `<expr> OP <literal>` (either side
    for ==, !=, <, <=, >, >=; value on the left for in / not in / is / is not), `[math.]isclose(<expr>,
    <literal>, rel_tol=…, abs_tol=…)`, `<expr>` and `not <expr>`. A "literal" is a Python literal, or
    set / frozenset / tuple / list / sorted / dict of one. Raises ValueError naming the assert."""
    try:
        tree = ast.parse(source.strip())
    except SyntaxError as e:
        raise ValueError(f"test {source!r} is not valid Python: {e.msg}") from e
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise ValueError(f"test {source!r}: expected exactly one `assert` statement")
    test = tree.body[0].test

    if isinstance(test, ast.Compare):
        if len(test.ops) != 1 or type(test.ops[0]) not in _AST_OPS:
            raise ValueError(f"test {source!r}: only a single comparison is supported")
        op, left, right = _AST_OPS[type(test.ops[0])], test.left, test.comparators[0]
        if _is_literal(left) and not _is_literal(right):
            if op not in _MIRROR:
                raise ValueError(f"test {source!r}: put the call on the left of {op!r}")
            op, left, right = _MIRROR[op], right, left
        expected = _literal(right, source)
        if op in ("is", "is not") and expected not in (None, True, False):
            raise ValueError(f"test {source!r}: `is` only against None, True or False")
        return CallTest(ast.unparse(left), expected, op=op, source=source)
    if isinstance(test, ast.Call) and _is_isclose(test.func):
        if len(test.args) != 2:
            raise ValueError(f"test {source!r}: isclose needs exactly two positional arguments")
        a, b = test.args
        if _is_literal(a) and not _is_literal(b):
            a, b = b, a
        kw = {k.arg: _literal(k.value, source) for k in test.keywords}
        unknown = set(kw) - {"rel_tol", "abs_tol"}
        if unknown:
            raise ValueError(f"test {source!r}: unknown isclose arguments {sorted(unknown)}")
        return CallTest(ast.unparse(a), _literal(b, source), op="isclose",
                        rel_tol=float(kw.get("rel_tol", 1e-9)), abs_tol=float(kw.get("abs_tol", 0.0)),
                        source=source)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return CallTest(ast.unparse(test.operand), None, op="falsy", source=source)
    if isinstance(test, (ast.Call, ast.Subscript, ast.Attribute, ast.Name)):
        # Truthiness is judged here on the plain value: an object with `__bool__` does not cross.
        return CallTest(ast.unparse(test), None, op="truthy", source=source)
    raise ValueError(f"test {source!r}: unsupported assert shape {type(test).__name__}")


_LITERAL_CALLS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "sorted": sorted,
                  "dict": dict}


def _literal_value(node: ast.AST) -> Any:
    """ast.literal_eval, plus `set([...])`-style wrappers around a literal (common in MBPP)."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _LITERAL_CALLS
            and len(node.args) <= 1 and not node.keywords):
        return _LITERAL_CALLS[node.func.id](*(_literal_value(a) for a in node.args))
    return ast.literal_eval(node)


def _is_literal(node: ast.AST) -> bool:
    try:
        _literal_value(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _literal(node: ast.AST, source: str) -> Any:
    try:
        return _literal_value(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"test {source!r}: {ast.unparse(node)!r} must be a Python literal (the "
                         "expected value is compared in the parent and never enters the sandbox)") from e


def _is_isclose(func: ast.AST) -> bool:
    return (isinstance(func, ast.Name) and func.id == "isclose") or (
        isinstance(func, ast.Attribute) and func.attr == "isclose")


# ---- decoding what came back ----------------------------------------------------------------------

class Undecodable(ValueError):
    pass


def decode(data: Any, depth: int = 0) -> Any:
    """Rebuild a value from the harness's tagged plain data, into exact built-in types only, so the
    `==` that follows is the built-in one."""
    if depth > 80:
        raise Undecodable("nested too deep")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v, depth + 1) for v in data]
    if type(data) is dict and len(data) == 1:
        (tag, v), = data.items()
        try:
            if tag == "tuple":
                return tuple(decode(x, depth + 1) for x in v)
            if tag == "set":
                return {decode(x, depth + 1) for x in v}
            if tag == "frozenset":
                return frozenset(decode(x, depth + 1) for x in v)
            if tag == "dict":
                return {decode(k, depth + 1): decode(x, depth + 1) for k, x in v}
            if tag == "float" and v in ("nan", "inf", "-inf"):
                return float(v)
            if tag == "complex":
                return complex(decode(v[0], depth + 1), decode(v[1], depth + 1))
            if tag == "bytes":
                return bytes.fromhex(v)
        except (TypeError, ValueError) as e:  # unhashable key, wrong arity, bad hex
            raise Undecodable(f"bad {tag}: {e}") from e
    raise Undecodable(f"not a value the harness writes: {str(data)[:80]}")


def matches(value: Any, test: CallTest) -> bool:
    """`value op expected` with both sides built-in types, so every operator is the built-in one."""
    if test.op == "isclose":
        if type(value) not in (int, float) or type(test.expected) not in (int, float):
            return False
        return math.isclose(value, test.expected, rel_tol=test.rel_tol, abs_tol=test.abs_tol)
    try:
        return bool(OPS[test.op](value, test.expected))
    except TypeError:  # e.g. `None < 3`: the comparison itself fails, so the assert would
        return False


# ---- verdicts ----------------------------------------------------------------------------------

def _limit_status(ex: Execution, finished: bool) -> Verdict | None:
    """Statuses that do not depend on the answer, in priority order."""
    n = 0
    if not ex.started:
        return Verdict(Status.SANDBOX_ERROR, 0, n, ex.error or "the sandbox did not start", ex.elapsed_s)
    if ex.output_exceeded:
        return Verdict(Status.OUTPUT_LIMIT, 0, n, f"{ex.output_exceeded} over the cap", ex.elapsed_s)
    if ex.timed_out and not finished:
        return Verdict(Status.TIMEOUT, 0, n, "wall-clock timeout", ex.elapsed_s)
    if any("memory" in r for r in ex.records):
        return Verdict(Status.MEMORY, 0, n, "MemoryError (address-space limit)", ex.elapsed_s)
    if ex.exit_code in (-24, 128 + 24):  # SIGXCPU: the CPU-time limit
        return Verdict(Status.TIMEOUT, 0, n, "CPU-time limit", ex.elapsed_s)
    return None


def judge_calls(ex: Execution, tests: list[CallTest]) -> Verdict:
    """Function tests: one record per call, in order, each compared here with its expected value."""
    results: dict[int, dict] = {}
    duplicate = False
    for r in ex.records:
        if "i" in r:
            duplicate |= r["i"] in results
            results.setdefault(r["i"], r)
    finished = len(results) == len(tests) and any(r.get("done") is True for r in ex.records)
    limit = _limit_status(ex, finished)
    if limit is not None:
        return Verdict(limit.status, 0, len(tests), limit.detail, ex.elapsed_s)
    for r in ex.records:
        if "load_error" in r:
            return Verdict(Status.RUNTIME_ERROR, 0, len(tests), f"loading the program: {r['load_error']}",
                           ex.elapsed_s)
    if ex.malformed or duplicate:
        return Verdict(Status.FAIL, 0, len(tests), "the result channel was tampered with", ex.elapsed_s)
    passed, first_failure, errored = 0, "", False
    for i, test in enumerate(tests):
        r = results.get(i)
        if r is None:
            return Verdict(Status.RUNTIME_ERROR, passed, len(tests),
                           f"the program ended before test {i} reported ({test.source or test.call})",
                           ex.elapsed_s)
        if "error" in r:
            errored = True
            first_failure = first_failure or f"{test.source or test.call}: {str(r['error'])[:300]}"
            continue
        try:
            ok = matches(decode(r.get("value")), test)
        except (Undecodable, RecursionError):
            ok = False
        if ok:
            passed += 1
        else:
            first_failure = first_failure or f"{test.source or test.call}: wrong value"
    if passed == len(tests):
        return Verdict(Status.PASS, passed, len(tests), "", ex.elapsed_s)
    status = Status.RUNTIME_ERROR if errored else Status.FAIL
    return Verdict(status, passed, len(tests), first_failure, ex.elapsed_s)


def normalize_output(text: str) -> str:
    lines = text.replace("\r\n", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).rstrip("\n")


def judge_stdio(ex: Execution, expected_stdout: str) -> Verdict:
    """A stdin → stdout program: passes only if it returned to the harness normally (exit 0) and its
    whole output equals the expected output (see departure 3)."""
    finished = any(r.get("done") is True for r in ex.records)
    limit = _limit_status(ex, finished)
    if limit is not None:
        return Verdict(limit.status, 0, 1, limit.detail, ex.elapsed_s)
    errors = [r["error"] for r in ex.records if "error" in r]
    if errors:
        return Verdict(Status.RUNTIME_ERROR, 0, 1, str(errors[0])[:300], ex.elapsed_s)
    exits = [r["exit"] for r in ex.records if "exit" in r]
    if not finished or not exits or any(e != 0 for e in exits):
        return Verdict(Status.RUNTIME_ERROR, 0, 1,
                       f"did not exit normally (exit records {exits[:3]}, process {ex.exit_code})",
                       ex.elapsed_s)
    try:
        out = ex.stdout.decode("utf-8")
    except UnicodeDecodeError:
        return Verdict(Status.FAIL, 0, 1, "output is not UTF-8", ex.elapsed_s)
    if normalize_output(out) == normalize_output(expected_stdout):
        return Verdict(Status.PASS, 1, 1, "", ex.elapsed_s)
    return Verdict(Status.FAIL, 0, 1, "wrong output", ex.elapsed_s)
