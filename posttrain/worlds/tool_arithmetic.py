"""Arithmetic past the tiny model's column work, where a calculator genuinely helps.

The world of the `arithmetic-tools` task (posttrain/tasks/arithmetic_tools.py). Its problems are one
step beyond the arithmetic world's L3/L4 — the tiny model does them in its head only by chaining
skills it has at 40–60% each, so it mostly gets them wrong — while a calculator call needs only
copying: the expression from the question into the call, the result into the answer.

| level | problems                               | a demonstration without the tool                              |
|-------|----------------------------------------|---------------------------------------------------------------|
| T1    | 2-digit × 2-digit                      | `<think>47*3=141, 47*80=3760, 141+3760=3901</think> 3901`     |
| T2    | three 3-digit numbers summed           | `<think>123+456=579, 579+789=1368</think> 1368`               |

With the tool (what the demonstrations that call it show; the call format is posttrain.envs'):

    user:      What is 47 * 83?
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "47 * 83"}}</tool_call>
    tool:      3901
    assistant: 3901

This module knows nothing of the call format or chat templates (it sits below `envs`): it gives the
problems, their held-out split, the mental-arithmetic working and the answer; the task builds the
chats. Answers are judged by the arithmetic world's `parse_answer` / `gold_reward` (the same format:
an optional `<think>…</think>`, then one integer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property

LEVELS: dict[str, str] = {
    "T1": "2-digit x 2-digit",
    "T2": "sum of three 3-digit numbers",
}
TEMPLATES = ("What is {e}?", "What is {c}?", "Compute {e}.", "Calculate {c}.", "{e} = ?")
EVAL_CAP = 2000  # held-out problems per level at most (T1 has 8,100 problems in all)


@dataclass(frozen=True, order=True)
class LongProblem:
    """`op` applied left to right over `operands` (all + or all ×)."""

    operands: tuple[int, ...]
    op: str  # "+" or "*"

    @property
    def value(self) -> int:
        out = self.operands[0]
        for x in self.operands[1:]:
            out = out + x if self.op == "+" else out * x
        return out

    @property
    def level(self) -> str:
        return "T1" if self.op == "*" else "T2"

    @property
    def expression(self) -> str:
        """What a calculator call carries: `47 * 83`."""
        return f" {self.op} ".join(map(str, self.operands))

    def working(self) -> str:
        """Mental arithmetic, one step per partial result (the <think> content of a no-tool answer)."""
        if self.op == "*":
            a, b = self.operands
            low, high = a * (b % 10), a * (b - b % 10)
            return f"{a}*{b % 10}={low}, {a}*{b - b % 10}={high}, {low}+{high}={self.value}"
        steps, acc = [], self.operands[0]
        for x in self.operands[1:]:
            steps.append(f"{acc}+{x}={acc + x}")
            acc += x
        return ", ".join(steps)


def sample_problem(level: str, rng: random.Random) -> LongProblem:
    if level == "T1":
        return LongProblem((rng.randint(10, 99), rng.randint(10, 99)), "*")
    if level == "T2":
        return LongProblem(tuple(rng.randint(100, 999) for _ in range(3)), "+")
    raise ValueError(f"unknown level {level!r}; expected one of {list(LEVELS)}")


def question(p: LongProblem, rng: random.Random) -> str:
    return rng.choice(TEMPLATES).format(e=p.expression, c=p.expression.replace(" ", ""))


def eval_question(p: LongProblem) -> str:
    """One fixed phrasing per held-out problem, so a checkpoint's score moves only with the checkpoint."""
    return TEMPLATES[0].format(e=p.expression)


def direct_answer(p: LongProblem) -> str:
    """The answer worked in the head, as the arithmetic world's demonstrations are: <think> then the number."""
    return f"<think>{p.working()}</think> {p.value}"


@dataclass
class ToolArithmeticWorld:
    """Problems per level, deterministic for a seed; the held-out ones are never drawn for training."""

    seed: int = 0
    eval_per_level: int = 200

    @cached_property
    def eval_problems(self) -> dict[str, list[LongProblem]]:
        """Held-out problems per level; a smaller eval is a prefix of a larger one (same seed)."""
        rng = random.Random(f"{self.seed}-tools-eval")
        n = min(self.eval_per_level, EVAL_CAP)
        out: dict[str, list[LongProblem]] = {}
        for level in LEVELS:
            seen: dict[LongProblem, None] = {}
            while len(seen) < n:
                seen.setdefault(sample_problem(level, rng), None)
            out[level] = list(seen)
        return out

    @cached_property
    def _held_out(self) -> frozenset[LongProblem]:
        return frozenset(p for ps in self.eval_problems.values() for p in ps)

    def train_problem(self, rng: random.Random, level: str | None = None) -> LongProblem:
        level = level or rng.choice(list(LEVELS))
        while True:
            p = sample_problem(level, rng)
            if p not in self._held_out:
                return p

    def train_problems(self, n: int, *, levels: list[str] | None = None, stream: str = "problems",
                       seed_offset: int = 0) -> list[LongProblem]:
        """`n` training problems, levels drawn uniformly from `levels` (default: every level)."""
        rng = random.Random(f"{self.seed}-tools-{stream}-{seed_offset}")
        return [self.train_problem(rng, rng.choice(levels) if levels else None) for _ in range(n)]
