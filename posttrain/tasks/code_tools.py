"""The `code-tools` task: write a small Python function, run it against visible tests, answer; hidden
tests decide the reward, in the sandbox (docs/tasks.md, docs/envs.md).

Problems: generated (posttrain/worlds/code_functions.py — levels C1 one integer operation, C2 a list
filter / count / scan, C3 a string rule; seeded, no download), or a user's JSONL file (`path`, the
schema below) instead. What the task supplies:

- `problems`: `Problem(prompt, tests=<hidden asserts>, level, meta={"entry_point", "visible"})`;
- `env`: the code environment (`envs/code_env.py`): tools `run_tests` (visible tests) and `python`
  (a session per episode by default); the answer is the last fenced code block of the turn without
  a tool call; reward = fraction of hidden tests passed (`reward: all`: all or nothing);
- `tokenizer_texts`: prompts and reference solutions, for a tiny model's tokenizer.

JSONL schema, one problem per line (every key but `level` and `name` required; others are errors):

    {"prompt": "def add(a, b): ... return a + b", "entry_point": "add",
     "visible_tests": ["assert add(1, 2) == 3"], "hidden_tests": ["assert add(-1, 1) == 0", ...],
     "level": "easy", "name": "add"}

Tests are `assert <call> == <literal>` strings (the shapes `sandbox.judge.parse_assert` accepts);
a bad row is a `CodeProblemError` naming the file, the line and the field.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from posttrain.data.records import Problem, Record
from posttrain.envs import EnvironmentFactory
from posttrain.envs.code_env import build_code_environment
from posttrain.sandbox import parse_assert
from posttrain.tasks.base import Capability, Task, TaskError
from posttrain.worlds.code_functions import LEVELS, CodeFunction, generate

NAME = "code-tools"
FIELDS = {"prompt": str, "entry_point": str, "visible_tests": list, "hidden_tests": list, "level": str, "name": str}
REQUIRED = ("prompt", "entry_point", "visible_tests", "hidden_tests")


class CodeProblemError(TaskError):
    """A bad row in a code-problem file: names the file, the line and the field."""


def as_problem(f: CodeFunction, origin: str) -> Problem:
    return Problem(prompt=f.prompt, tests=list(f.hidden), level=f.level,
                   meta={"entry_point": f.name, "visible": list(f.visible)}, origin=origin)


def _check_tests(where: str, field: str, value: Any, entry_point: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise CodeProblemError(f"{where}: field {field!r}: expected a non-empty list of assert strings")
    for k, t in enumerate(value):
        if not isinstance(t, str):
            raise CodeProblemError(f"{where}: field {field!r}[{k}]: expected an assert string, got {type(t).__name__}")
        try:
            test = parse_assert(t)
        except ValueError as e:
            raise CodeProblemError(f"{where}: field {field!r}[{k}]: {e}") from None
        if entry_point not in test.call:
            raise CodeProblemError(f"{where}: field {field!r}[{k}]: {t!r} does not call the entry point {entry_point!r}")
    return list(value)


def read_code_problems(path: str | Path) -> list[Problem]:
    """A user's code problems (module docstring's schema), validated row by row."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise CodeProblemError(f"{path}: cannot read the code-problem file: {e}") from None
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise CodeProblemError(f"{where}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise CodeProblemError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key in row:
            if key not in FIELDS:
                raise CodeProblemError(f"{where}: unknown field {key!r}; expected some of {list(FIELDS)}")
        for key in REQUIRED:
            if key not in row:
                raise CodeProblemError(f"{where}: missing field {key!r}")
        for key, kind in FIELDS.items():
            if key in row and not isinstance(row[key], kind):
                raise CodeProblemError(f"{where}: field {key!r}: expected {kind.__name__}, got {type(row[key]).__name__}")
        if not row["entry_point"].isidentifier():
            raise CodeProblemError(f"{where}: field 'entry_point': {row['entry_point']!r} is not a Python name")
        visible = _check_tests(where, "visible_tests", row["visible_tests"], row["entry_point"])
        hidden = _check_tests(where, "hidden_tests", row["hidden_tests"], row["entry_point"])
        prompt = row["prompt"] + "\n\nVisible tests (run them with the run_tests tool):\n" + "\n".join(visible) + \
            "\n\nAnswer with the whole function in one ```python block, in a turn without a tool call."
        out.append(Problem(prompt=prompt, tests=hidden, level=row.get("level"),
                           meta={"entry_point": row["entry_point"], "visible": visible},
                           origin=f"{path.name}:{n}" + (f" ({row['name']})" if "name" in row else "")))
    if not out:
        raise CodeProblemError(f"{path}: no problems in the file")
    return out


class CodeToolsTask(Task):
    name = NAME
    capabilities = frozenset({Capability.PROBLEMS, Capability.ENV, Capability.TOKENIZER})

    def __init__(self, *, seed: int = 0, path: str | Path | None = None, env: dict[str, Any] | None = None):
        self._seed, self.path, self.env_defaults = seed, path, dict(env or {})

    @cached_property
    def file_problems(self) -> list[Problem] | None:
        return None if self.path is None else read_code_problems(self.path)

    @property
    def levels(self) -> tuple[str, ...]:  # type: ignore[override]
        if self.file_problems is None:
            return LEVELS
        return tuple(dict.fromkeys(str(p.level) for p in self.file_problems if p.level is not None))

    def _records(self, kind: str, n: int, *, seed_offset: int, levels: Sequence[str] | None) -> list[Record]:
        if self.file_problems is not None:
            rows = [p for p in self.file_problems if levels is None or str(p.level) in levels]
            return [rows[i % len(rows)] for i in range(n)]
        fns = generate(n, seed=self._seed, levels=list(levels) if levels else None, stream=f"problem-{seed_offset}")
        return [as_problem(f, f"{NAME}[{i}]") for i, f in enumerate(fns)]

    def environment(self, **params: Any) -> EnvironmentFactory:
        """The code environment (`envs/code_env.py`); `params` override the task's defaults."""
        return build_code_environment(**{**self.env_defaults, **params})

    def tokenizer_texts(self) -> list[str]:
        rng = random.Random(f"{self._seed}-code-tokenizer")
        texts = []
        for f in generate(600, seed=self._seed, stream="tokenizer"):
            call = json.dumps({"name": "run_tests", "arguments": {"code": f.solution}})
            texts.append(f"{f.prompt}\n<tool_call>{call}</tool_call>\n```python\n{f.solution}```\n"
                         + ("\n".join(f.visible) if rng.random() < 0.5 else ""))
        return texts
