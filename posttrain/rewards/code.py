"""The `code` verifier: unit tests run in the sandbox, judged in this process.

Interface shared with the other verifiers: `(completions, **columns) -> list[float | None]`.
Columns it reads (one entry per completion):
- `tests`: a list of MBPP / HumanEval-style assert strings (`"assert add(1, 2) == 3"`) — function
  tests — or a list of `{"stdin": str, "stdout": str}` dicts — a stdin → stdout program run once
  per case;
- `test_setup` (optional): code run before the program, MBPP's `test_setup_code`.
Other columns (an `answer` for `math`, …) are ignored: they belong to other verifiers.

Reward: 1.0 if every test passed, else 0.0 (`partial_credit=True`: the fraction passed); `None`
when the sandbox itself failed — not judged, to be counted by the caller, never a silent 0.
`CodeVerifier.verdicts` returns the full `Verdict`s (status, detail) for metrics and logs.

Departures from HumanEval's `check_correctness` / MBPP's exec harness:
1. The program runs under OS isolation (`posttrain.sandbox`), not `reliability_guard` + an alarm.
2. Asserts are split into call and expected value in the parent (`posttrain.sandbox.judge`); the
   expected values never enter the sandbox and the candidate's exit code is never evidence.
3. The program is the last fenced code block of the completion (```python, ```py or bare ```),
   an unterminated final fence included (a truncated generation); with no fence, the whole text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from posttrain.rewards.base import VerifierInputError
from posttrain.sandbox import Limits, SandboxPool, Verdict, judge_programs, open_sandbox, parse_tests

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_program(completion: str) -> str:
    """The program in a completion: the last fenced block, else the whole text."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


class CodeVerifier:
    """A `code` verifier bound to a sandbox pool. Opens one (`backend`, `limits`, `concurrency`)
    unless given `pool`; `close()` closes a pool it opened."""

    def __init__(self, pool: SandboxPool | None = None, *, backend: str = "bubblewrap",
                 limits: Limits | None = None, concurrency: int | None = None,
                 partial_credit: bool = False) -> None:
        self._owns_pool = pool is None
        self.pool = pool or open_sandbox(backend, limits=limits, concurrency=concurrency)
        self.limits = limits
        self.partial_credit = partial_credit

    def verdicts(self, completions: Sequence[str], **columns: object) -> list[Verdict]:
        tests = columns.get("tests")
        if tests is None:
            raise VerifierInputError("the code verifier needs a `tests` column (assert strings or "
                             "{'stdin', 'stdout'} dicts per completion); got columns "
                             f"{sorted(columns)}")
        setups = columns.get("test_setup")
        _check_len("tests", tests, completions)
        if setups is not None:
            _check_len("test_setup", setups, completions)
        programs = []
        for k, completion in enumerate(completions):
            if not isinstance(completion, str):
                raise VerifierInputError(f"code verifier: completions[{k}] is a {type(completion).__name__}, "
                                 "expected str")
            row_tests = tests[k]  # type: ignore[index]
            if not isinstance(row_tests, (list, tuple)):
                raise VerifierInputError(f"code verifier: tests[{k}] must be a list of tests, got "
                                 f"{type(row_tests).__name__}")
            setup = (setups[k] if setups is not None else None) or ""  # type: ignore[index]
            try:
                parsed = parse_tests(row_tests, f"code verifier: tests[{k}]")
            except ValueError as e:
                raise VerifierInputError(str(e)) from e
            programs.append((extract_program(completion), parsed, setup))
        return judge_programs(self.pool, programs, self.limits)

    def __call__(self, completions: Sequence[str], **columns: object) -> list[float | None]:
        out: list[float | None] = []
        for v in self.verdicts(completions, **columns):
            if v.reward is None or not self.partial_credit:
                out.append(v.reward)
            else:
                out.append(v.passed / v.total if v.total else 0.0)
        return out

    def close(self) -> None:
        if self._owns_pool:
            self.pool.close()


def _check_len(name: str, column: object, completions: Sequence[str]) -> None:
    if not isinstance(column, Sequence) or isinstance(column, str) or len(column) != len(completions):
        n = len(column) if isinstance(column, Sequence) else type(column).__name__
        raise VerifierInputError(f"code verifier: column `{name}` must hold one entry per completion "
                         f"({len(completions)}), got {n}")
