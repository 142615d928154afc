"""The `code-tools` task: write a small Python function, run it against visible tests, answer; hidden
tests decide the reward, in the sandbox (docs/tasks.md, docs/envs.md).

Problems: generated (posttrain/worlds/code_functions.py — levels C1 one integer operation, C2 a list
filter / count / scan, C3 a string rule; seeded, no download), or a user's JSONL file (`path`, the
schema below) instead. What the task supplies:

- `problems`: `Problem(prompt, tests=<hidden asserts>, level, meta={"entry_point", "visible_tests"})`;
- `env`: the code environment (`envs/code_env.py`): tools `run_tests` (visible tests) and `python`
  (a session per episode by default); the answer is the last fenced code block of the turn without
  a tool call; reward = fraction of hidden tests passed (`reward: all`: all or nothing);
- `evals`: greedy episodes in that environment on held-out problems per level (generated: a separate
  seeded draw, `EVAL_PER_LEVEL` per level; a file: its rows): `pass` (every hidden test passed, the
  episode ended with an answer) and `tool_use` (share of episodes with a tool call), per level and
  pooled. Families with few constants repeat across draws (`running_max` and `run_lengths` have
  none: their held-out problems differ from training ones only in their tests);
- `tokenizer_texts`: prompts and reference solutions, for a tiny model's tokenizer.

JSONL schema, one problem per line: the `problem` schema (docs/data.md) with the hidden tests in
`tests` and two more fields — every key but `level` and `name` required, others are errors:

    {"prompt": "def add(a, b): ... return a + b", "entry_point": "add",
     "visible_tests": ["assert add(1, 2) == 3"], "tests": ["assert add(-1, 1) == 0", ...],
     "level": "easy", "name": "add"}

So the same file also reads as `{path: file.jsonl}` in a GRPO stage with `env: {name: code}` (the
extra fields land in `Problem.meta`; the environment checks every problem before the stage starts).

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
import torch

from posttrain.envs import EnvironmentFactory, EpisodeEnd
from posttrain.envs.code_env import build_code_environment
from posttrain.sandbox import parse_assert
from posttrain.tasks.base import Capability, EvalRequest, PhaseFn, Task, TaskError
from posttrain.tasks.episode_eval import evaluate_episodes
from posttrain.tasks.records import EvalRecord
from posttrain.worlds.code_functions import LEVELS, CodeFunction, generate

NAME = "code-tools"
FIELDS = {"prompt": str, "entry_point": str, "visible_tests": list, "tests": list, "level": str, "name": str}
REQUIRED = ("prompt", "entry_point", "visible_tests", "tests")
EVAL_PER_LEVEL = 50  # generated held-out problems per level
EVAL_TURNS = 3       # e.g. run_tests, python, answer


class CodeProblemError(TaskError):
    """A bad row in a code-problem file: names the file, the line and the field."""


def as_problem(f: CodeFunction, origin: str) -> Problem:
    return Problem(prompt=f.prompt, tests=list(f.hidden), level=f.level,
                   meta={"entry_point": f.name, "visible_tests": list(f.visible)}, origin=origin)


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
        hidden = _check_tests(where, "tests", row["tests"], row["entry_point"])
        out.append(Problem(prompt=row["prompt"], tests=hidden, level=row.get("level"),
                           meta={"entry_point": row["entry_point"], "visible_tests": visible},
                           origin=f"{path.name}:{n}" + (f" ({row['name']})" if "name" in row else "")))
    if not out:
        raise CodeProblemError(f"{path}: no problems in the file")
    return out


class CodeToolsTask(Task):
    name = NAME
    capabilities = frozenset({Capability.PROBLEMS, Capability.ENV, Capability.TOKENIZER, Capability.EVALS})

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

    # ---- evals -----------------------------------------------------------------------------------
    def eval_problems(self, level: str | None) -> list[Problem]:
        if self.file_problems is not None:
            return [p for p in self.file_problems if level is None or str(p.level) == level]
        if level not in LEVELS:
            raise TaskError(f"task {NAME!r}: unknown level {level!r}; expected one of {list(LEVELS)}")
        fns = generate(EVAL_PER_LEVEL, seed=self._seed, levels=[level], stream="eval")
        return [as_problem(f, f"{NAME}.eval[{level}][{i}]") for i, f in enumerate(fns)]

    @torch.no_grad()
    def evaluate(self, model: Any, tok: Any, request: EvalRequest, *, stage: str, checkpoint: str,
                 phase: PhaseFn | None = None) -> list[EvalRecord]:
        """Greedy episodes (≤ 3 turns of ≤ `max_new_tokens`, the model's context in all): `pass` — the
        episode ended with an answer that passed every hidden test — and `tool_use`, per level and pooled."""
        return evaluate_episodes(self, model, tok, request, stage=stage, checkpoint=checkpoint, phase=phase,
                                 metric="pass", correct=lambda p, e: e.end is EpisodeEnd.DONE and e.reward == 1.0, turns=EVAL_TURNS)

    def tokenizer_texts(self) -> list[str]:
        rng = random.Random(f"{self._seed}-code-tokenizer")
        texts = []
        for f in generate(600, seed=self._seed, stream="tokenizer"):
            call = json.dumps({"name": "run_tests", "arguments": {"code": f.solution}})
            texts.append(f"{f.prompt}\n<tool_call>{call}</tool_call>\n```python\n{f.solution}```\n"
                         + ("\n".join(f.visible) if rng.random() < 0.5 else ""))
        return texts
