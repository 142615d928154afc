"""`CodeEnv`: write a function, run it against the visible tests, answer; hidden tests decide the reward.

    reset(problem)  → the problem's prompt (signature, description, visible tests)
    step(text)      → tool calls: `run_tests` (the code against the visible tests, a report per test)
                      and `python` (a session kept for the episode, or a fresh process per call);
                      reward 0.0 at each such step
                    → no call: the answer — the **last fenced code block of the turn** (```python, ```py
                      or bare ```; an unterminated last fence counts; with no fence, the whole turn:
                      `rewards.code.extract_program`) runs against the hidden tests in the sandbox;
                      reward = the fraction passed (`reward: all`: 1.0 only when every one passed), done

A problem carries its hidden tests in `Problem.tests` and its visible ones in `meta["visible_tests"]`
(a `problem` JSONL row's extra field `visible_tests` lands there), both as `assert f(args) == expected`
strings; the prompt gets the visible ones appended if it does not already show them. Each test is
split in this process into the call, which runs in the sandbox, and the expected value, which stays
here (`sandbox.judge.parse_assert`) — the expected outputs of the hidden tests never enter any
sandbox, and no tool call's sandbox gets the hidden calls either (only the answer's run does).

Every program runs with the harness's audit hook: its attempts to read files outside its own, list
directories, inspect its caller's frames, the garbage collector or the environment are counted
(`StepResult.hidden_probes`), the answer's hidden-test run included; nothing is there to find.

Departures from the code-agent setups this follows (SWE-style "run the tests, then submit"):
1. The reward is the fraction of hidden tests passed by default (denser for a small model than
   all-or-nothing, which `reward: all` gives), so a partly right answer is not worth 0.
2. The answer is read from the final turn only, never from a tool call's code: the model must
   restate the function it wants judged.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from posttrain.data.records import Message, Problem, prompt_messages
from posttrain.envs.base import EnvironmentConfigError, EnvironmentFactory, StepResult
from posttrain.envs.tool_calls import ToolCall, parse_tool_calls
from posttrain.envs.tool_env import tools_system_prompt
from posttrain.envs.tools import (DEFAULT_PYTHON_LIMITS, MAX_RESULT_CHARS, PythonSessionTool, PythonTool, Tool,
                                  ToolResult, run_calls)
from posttrain.rewards.code import extract_program
from posttrain.sandbox import CallTest, Job, Limits, SandboxPool, Status, judge_calls, open_sandbox, parse_assert
from posttrain.sandbox.execution import Execution, probe_count
from posttrain.sandbox.judge import Undecodable, decode, matches
from posttrain.sandbox.session import SessionHost

PYTHON_MODES = ("session", "stateless", "none")


class SharedPool:
    """One sandbox pool for every episode of a factory, opened on first use."""

    def __init__(self, backend: str, limits: Limits, concurrency: int | None = None):
        self.backend, self.limits, self.concurrency = backend, limits, concurrency
        self._pool: SandboxPool | None = None
        self._lock = threading.Lock()

    def get(self) -> SandboxPool:
        with self._lock:
            if self._pool is None:
                self._pool = open_sandbox(self.backend, concurrency=self.concurrency, limits=self.limits)
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def run_tests_on(pool: SandboxPool, code: str, tests: Sequence[CallTest], limits: Limits) -> Execution:
    """`code`, then each test's call, in the sandbox with the audit hook; expected values stay here."""
    return pool.run(Job(code, calls=tuple(t.call for t in tests), audit=True), limits)


def test_report(ex: Execution, tests: Sequence[CallTest]) -> ToolResult:
    """What `run_tests` tells the model: one line per visible test, then a count."""
    verdict = judge_calls(ex, list(tests))
    probes = probe_count(ex.records)
    if verdict.status in (Status.TIMEOUT, Status.MEMORY, Status.OUTPUT_LIMIT, Status.SANDBOX_ERROR):
        return ToolResult(f"error: {verdict.status.value}: {verdict.detail}", error=True, probes=probes)
    load = [r["load_error"] for r in ex.records if "load_error" in r]
    if load:
        return ToolResult(f"error: the code did not run: {str(load[0])[:300]}", error=True, probes=probes)
    by_index = {r["i"]: r for r in ex.records if "i" in r}
    lines = []
    for i, t in enumerate(tests):
        r = by_index.get(i)
        if r is None:
            lines.append(f"{t.source}: not run")
        elif "error" in r:
            lines.append(f"{t.source}: error: {str(r['error'])[:200]}")
        else:
            try:
                value = decode(r.get("value"))
                ok = matches(value, t)
            except (Undecodable, RecursionError):
                value, ok = "<undecodable>", False
            lines.append(f"{t.source}: ok" if ok else f"{t.source}: FAIL (got {value!r:.200})")
    passed = sum(line.endswith(": ok") for line in lines)
    return ToolResult("\n".join(lines) + f"\n{passed}/{len(tests)} visible tests passed", probes=probes)


class RunTests:
    """`run_tests`: the model's code against its problem's visible tests (bound to one episode)."""

    name = "run_tests"
    description = 'runs your function against the visible tests: {"code": "def f(x):\\n    return x"}'

    def __init__(self, pool: SharedPool, tests: Sequence[CallTest], limits: Limits):
        self.pool, self.tests, self.limits = pool, list(tests), limits

    def run(self, calls: Sequence[dict[str, Any]]) -> list[ToolResult]:
        out = []
        for args in calls:
            code = args.get("code")
            if not isinstance(code, str) or set(args) != {"code"}:
                out.append(ToolResult('error: run_tests takes exactly {"code": "<your function>"}', error=True))
                continue
            out.append(test_report(run_tests_on(self.pool.get(), code, self.tests, self.limits), self.tests))
        return out


VISIBLE_HEADER = "Visible tests (run them with the run_tests tool):"
ANSWER_LINE = "Answer with the whole function in one ```python block, in a turn without a tool call."


def _parsed(problem: Problem, field: str, raw: Any) -> list[CallTest]:
    where = problem.origin or f"problem {problem.prompt!r:.60}"
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: field {field!r}: a code problem needs a non-empty list of assert strings")
    out = []
    for k, t in enumerate(raw):
        if not isinstance(t, str):
            raise ValueError(f"{where}: field {field!r}[{k}]: expected an assert string, got {type(t).__name__}")
        try:
            out.append(parse_assert(t))
        except ValueError as e:
            raise ValueError(f"{where}: field {field!r}[{k}]: {e}") from None
    return out


def split_tests(problem: Problem) -> tuple[list[CallTest], list[CallTest]]:
    """(visible, hidden) of a code problem; ValueError naming the problem (a file's `path:line`) and
    the field when either is missing or not assert strings."""
    return (_parsed(problem, "visible_tests", problem.meta.get("visible_tests")),
            _parsed(problem, "tests", problem.tests))


def validate_problems(problems: Sequence[Problem]) -> None:
    """Every problem has visible and hidden tests the parent can split (before a stage starts)."""
    for p in problems:
        split_tests(p)


def code_prompt(problem: Problem) -> str:
    """The problem's prompt, with its visible tests and the answer rule appended unless it shows them."""
    text = problem.prompt if isinstance(problem.prompt, str) else ""
    visible = problem.meta.get("visible_tests") or []
    if all(v in text for v in visible):
        return text
    return f"{text}\n\n{VISIBLE_HEADER}\n" + "\n".join(visible) + f"\n\n{ANSWER_LINE}"


class CodeEnv:
    """One episode of a code problem (module docstring). `python`: a `PythonSessionTool` made for
    this episode, a shared stateless `PythonTool`, or None."""

    def __init__(self, pool: SharedPool, limits: Limits, *, host: SessionHost | None = None,
                 stateless: PythonTool | None = None, reward: str = "fraction", max_calls: int = 4,
                 max_result_chars: int = MAX_RESULT_CHARS, system_prompt: bool = False):
        self.pool, self.limits, self.host, self.stateless = pool, limits, host, stateless
        self.system_prompt = system_prompt
        self.reward_rule, self.max_calls, self.max_result_chars = reward, max_calls, max_result_chars
        self.tools: dict[str, Tool] = {}
        self.hidden: list[CallTest] = []
        self._session: PythonSessionTool | None = None

    def reset(self, problem: Problem) -> list[Message]:
        visible, self.hidden = split_tests(problem)
        self.tools = {"run_tests": RunTests(self.pool, visible, self.limits)}
        if self.host is not None:
            self._session = PythonSessionTool(self.host)
            self.tools["python"] = self._session
        elif self.stateless is not None:
            self.tools["python"] = self.stateless
        messages = prompt_messages(code_prompt(problem) if isinstance(problem.prompt, str) else problem.prompt)
        if self.system_prompt:
            messages = [Message("system", tools_system_prompt(self.tools))] + messages
        return messages

    def step(self, assistant_message: str) -> StepResult:
        parsed = parse_tool_calls(assistant_message, max_calls=self.max_calls)
        if parsed.has_calls:
            results = run_calls(parsed, self.tools, max_chars=self.max_result_chars)
            ran = sum(isinstance(i, ToolCall) and i.name in self.tools for i in parsed.items)
            return StepResult([Message("tool", r.content) for r in results], 0.0, done=False, tool_calls=ran,
                              tool_errors=sum(r.error for r in results),
                              hidden_probes=sum(r.probes for r in results))
        reward, probes = self.judge(assistant_message)
        return StepResult([], reward, done=True, hidden_probes=probes)

    def judge(self, text: str) -> tuple[float | None, int]:
        """The answer against the hidden tests: (reward, probes). None if the sandbox itself failed."""
        ex = run_tests_on(self.pool.get(), extract_program(text), self.hidden, self.limits)
        verdict = judge_calls(ex, self.hidden)
        if verdict.status is Status.SANDBOX_ERROR:
            return None, probe_count(ex.records)
        if self.reward_rule == "all":
            return float(verdict.status is Status.PASS), probe_count(ex.records)
        return verdict.passed / len(self.hidden), probe_count(ex.records)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


def build_code_environment(*, python: str = "session", reward: str = "fraction", max_calls: int = 4,
                           max_result_chars: int = MAX_RESULT_CHARS, limits: dict[str, Any] | None = None,
                           sandbox: str = "bubblewrap", concurrency: int | None = None,
                           system_prompt: bool = False) -> EnvironmentFactory:
    """The factory of `CodeEnv`s (an `EnvironmentFactory`: close it). Parameters: `python` (session |
    stateless | none), `reward` (fraction | all), `max_calls`, `max_result_chars`, `limits` (a `Limits`
    dict for every program: tool calls and the hidden run), `sandbox` (bubblewrap | unsafe-subprocess),
    `system_prompt` (a system message listing the tools and the call format; off by default: the
    prompt names `run_tests`, and a tiny model's context has no room for it)."""
    if python not in PYTHON_MODES:
        raise EnvironmentConfigError(f"code environment: python must be one of {PYTHON_MODES}, got {python!r}")
    if reward not in ("fraction", "all"):
        raise EnvironmentConfigError(f"code environment: reward must be 'fraction' or 'all', got {reward!r}")
    lim = DEFAULT_PYTHON_LIMITS if limits is None else Limits(**limits)
    pool = SharedPool(sandbox, lim, concurrency)
    host = SessionHost(sandbox, lim) if python == "session" else None
    stateless = PythonTool(backend=sandbox, limits=lim) if python == "stateless" else None
    owned: list[Any] = [pool, *(x for x in (host, stateless) if x is not None)]
    return EnvironmentFactory(lambda: CodeEnv(pool, lim, host=host, stateless=stateless, reward=reward,
                                              max_calls=max_calls, max_result_chars=max_result_chars,
                                              system_prompt=system_prompt), owned, validate=validate_problems)
