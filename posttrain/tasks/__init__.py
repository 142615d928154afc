"""Tasks: where a stage's data, problems, held-out evals and gold judges come from (docs/tasks.md).

Built in: `arithmetic` (the world of posttrain/worlds/arithmetic.py), `code` (posttrain/worlds/code.py
in the sandbox), `humaneval` (eval-only), and `jsonl` (a user's files, judged by a named verifier).
Nothing of a task is built until a stage or an eval asks for it.
"""

from posttrain.tasks.base import Capability, EvalRequest, MissingCapability, Task, TaskError
from posttrain.tasks.records import EvalRecord, binomial_stderr
from posttrain.tasks.registry import BUILTIN, MissingTask, TaskSet, build_task

__all__ = ["BUILTIN", "Capability", "EvalRecord", "EvalRequest", "MissingCapability", "MissingTask", "Task", "TaskError",
           "TaskSet", "binomial_stderr", "build_task"]
