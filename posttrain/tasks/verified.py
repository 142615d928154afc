"""Tasks judged by a named verifier: `jsonl` (a user's files in our schemas) and `code` (the built-in
function and stdin → stdout problems of posttrain/worlds/code.py, judged in the sandbox).

A reply passes when the verifier scores it at least `threshold` (0.5: the `math` verifier gives 1 or
0; `code` gives 1 when every test passes). A reply the verifier cannot judge (None) fails and is
counted in `skipped`. The verifier is built on first use and closed with `close()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from posttrain.data import read_jsonl
from posttrain.data.records import Problem, Record
from posttrain.rewards import WeightedVerifier, build_verifier, combine
from posttrain.tasks.base import Capability, Task
from posttrain.worlds.code import problem_rows


class VerifiedTask(Task):
    """Problems judged by a `posttrain.rewards` verifier (subclasses supply the problems)."""

    def __init__(self, name: str, verifier: str, *, params: dict[str, Any] | None = None, threshold: float = 0.5):
        self.name, self.verifier_name, self.params, self.threshold = name, verifier, dict(params or {}), threshold
        self.skipped = 0

    @cached_property
    def verifier(self) -> WeightedVerifier:
        return WeightedVerifier(self.verifier_name, build_verifier(self.verifier_name, **self.params))

    def judge(self, problems: Sequence[Problem], texts: Sequence[str], finish: Sequence[str]) -> list[bool]:
        cols: dict[str, Any] = {"answer": [p.answer for p in problems], "level": [p.level for p in problems]}
        if any(p.tests is not None for p in problems):
            cols["tests"] = [p.tests for p in problems]
        scores = combine([self.verifier], list(texts), **cols).per_verifier[self.verifier_name]
        self.skipped += sum(s is None for s in scores)
        return [s is not None and s >= self.threshold for s in scores]

    def close(self) -> None:
        if "verifier" in self.__dict__:
            close = getattr(self.verifier.verifier, "close", None)
            if close is not None:
                close()


class JsonlTask(VerifiedTask):
    """A user's `problem` JSONL file (docs/data.md) as held-out evals, judged by the named verifier.

    Levels are the file's `level` values in first-appearance order (none: one set, level None)."""

    capabilities = frozenset({Capability.EVALS, Capability.PROBLEMS})

    def __init__(self, path: str | Path, verifier: str, *, name: str | None = None, params: dict[str, Any] | None = None):
        super().__init__(name or Path(path).stem, verifier, params=params)
        self.path = Path(path)

    @cached_property
    def problems_in_file(self) -> list[Problem]:
        return read_jsonl(self.path, "problem").records  # type: ignore[return-value]

    @property
    def levels(self) -> tuple[str, ...]:  # type: ignore[override]
        seen: dict[str, None] = {}
        for p in self.problems_in_file:
            if p.level is not None:
                seen.setdefault(str(p.level), None)
        return tuple(seen)

    def eval_problems(self, level: str | None) -> list[Problem]:
        return [p for p in self.problems_in_file if level is None or str(p.level) == level]

    def _records(self, kind: str, n: int, *, seed_offset: int, levels: Sequence[str] | None) -> list[Record]:
        rows = [p for p in self.problems_in_file if levels is None or str(p.level) in levels]
        return rows[:n]  # type: ignore[return-value]


class CodeTask(VerifiedTask):
    """The built-in code problems (levels `function`, `stdio`), judged by the `code` verifier in the
    sandbox. Twelve problems: enough to exercise the path end to end, far too few to train on, so the
    same problems serve as `problems` and as evals (said so at start-up by `describe`)."""

    capabilities = frozenset({Capability.EVALS, Capability.PROBLEMS})
    levels = ("function", "stdio")

    def __init__(self, *, params: dict[str, Any] | None = None):
        super().__init__("code", "code", params=params)

    def eval_problems(self, level: str | None) -> list[Problem]:
        return [Problem(prompt=r["prompt"], tests=r["tests"], level=r["level"],
                        meta={"entry_point": r["entry_point"], "name": r["name"]}, origin=f"code[{r['name']}]")
                for r in problem_rows(level)]

    def _records(self, kind: str, n: int, *, seed_offset: int, levels: Sequence[str] | None) -> list[Record]:
        rows = [p for lv in (levels or self.levels) for p in self.eval_problems(lv)]
        return [rows[i % len(rows)] for i in range(n)]  # type: ignore[misc]

    def describe(self) -> str:
        return super().describe() + " (its 12 training problems are its eval problems)"
