"""The `arithmetic-tools` task: arithmetic past the tiny model's column work, with a calculator tool.

Problems (posttrain/worlds/tool_arithmetic.py): T1 2-digit × 2-digit, T2 three 3-digit numbers
summed — one step beyond the arithmetic world's L3/L4, so a tiny model working them in its head
mostly gets them wrong, while a calculator call only needs copying. What the task supplies:

- `sft`: chats on training problems; a share `tool_share` (default 0.4: a minority) call the
  calculator — user → assistant `<tool_call>…</tool_call>` → tool result → assistant answer — and the
  rest work the problem in the head (`<think>47*3=141, 47*80=3760, 141+3760=3901</think> 3901`). The
  tool result is a `tool` message, so the SFT loss (every assistant turn, never another role) covers
  the call and the answer and never the result.
- `problems`, `gold_judge`: the problems with their answers; the arithmetic world's judge.
- `env`: the environment its problems are played in — `tools` with the calculator and no system
  prompt (the tiny model's context is 160–256 tokens; the demonstrations teach the format instead).
  GRPO's `env: {name: task}` takes it from the stage's first data task that has one.
- `evals`: greedy episodes in that environment on held-out problems per level: `exact_match` (the
  episode ended with an answer turn and its final integer is right) and `tool_use` (share of episodes
  with at least one calculator call), per level and pooled.
- `tokenizer_texts`: the chats as text, so a from-scratch tokenizer learns the call's JSON.

Why a task of its own and not a level of `arithmetic`: its evals are episodes (a different eval row
family, with tool use), it supplies an environment and no preference data, and adding levels to
`arithmetic` would change that task's level mix and eval table under every existing recipe.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch

from posttrain.data.records import Message, Problem, Record, SFTExample
from posttrain.envs import EnvironmentFactory, build_environment, format_call
from posttrain.envs.episodes import Episode, EpisodeEnd
from posttrain.tasks.base import Capability, EvalRequest, PhaseFn, Task, TaskError
from posttrain.tasks.episode_eval import evaluate_episodes
from posttrain.tasks.records import EvalRecord
from posttrain.worlds.arithmetic import gold_reward, parse_answer
from posttrain.worlds.tool_arithmetic import (
    LEVELS,
    LongProblem,
    ToolArithmeticWorld,
    direct_answer,
    eval_question,
    question,
)

NAME = "arithmetic-tools"
DEFAULT_ENV: dict[str, Any] = {"tools": ["calculator"], "system_prompt": False}
EVAL_TURNS = 3  # a call, an answer, and one turn of slack (a second call)


def tool_chat(p: LongProblem, prompt: str) -> list[Message]:
    """A demonstration that calls the calculator: the call, the tool's result, the answer."""
    return [Message("user", prompt),
            Message("assistant", format_call("calculator", {"expression": p.expression})),
            Message("tool", str(p.value)),
            Message("assistant", str(p.value))]


def direct_chat(p: LongProblem, prompt: str) -> list[Message]:
    return [Message("user", prompt), Message("assistant", direct_answer(p))]


def as_problem(p: LongProblem, prompt: str, origin: str) -> Problem:
    return Problem(prompt=prompt, answer=str(p.value), level=p.level,
                   meta={"operands": list(p.operands), "op": p.op}, origin=origin)


def episode_correct(problem: Problem, episode: Episode) -> bool:
    """The episode ended with an answer turn the model finished (not cut at a token budget, not at the
    turn budget) and that turn's final integer is the answer."""
    return (episode.end is EpisodeEnd.DONE and episode.finish == "stop"
            and parse_answer(episode.final_text) == int(str(problem.answer)))


class ArithmeticToolsTask(Task):
    name = NAME
    capabilities = frozenset({Capability.SFT, Capability.PROBLEMS, Capability.EVALS, Capability.GOLD,
                              Capability.TOKENIZER, Capability.ENV})
    levels = tuple(LEVELS)

    def __init__(self, *, seed: int = 0, eval_per_level: int = 200, tool_share: float = 0.4):
        if not 0.0 <= tool_share <= 1.0:
            raise TaskError(f"task {NAME!r}: tool_share must be in [0, 1], got {tool_share}")
        self._seed, self._eval_per_level, self.tool_share = seed, eval_per_level, tool_share

    @cached_property
    def world(self) -> ToolArithmeticWorld:
        return ToolArithmeticWorld(seed=self._seed, eval_per_level=max(200, self._eval_per_level))

    # ---- data ------------------------------------------------------------------------------------
    def _records(self, kind: str, n: int, *, seed_offset: int, levels: Sequence[str] | None) -> list[Record]:
        rng = random.Random(f"{self._seed}-tools-{kind}-phrasing-{seed_offset}")
        problems = self.world.train_problems(n, levels=list(levels) if levels else None, stream=kind,
                                             seed_offset=seed_offset)
        if kind == "problem":
            return [as_problem(p, question(p, rng), f"{NAME}[{i}]") for i, p in enumerate(problems)]
        # sft: which examples call the tool is drawn from its own stream, so tool_share moves nothing else
        calls = random.Random(f"{self._seed}-tools-share-{seed_offset}")
        out: list[Record] = []
        for i, p in enumerate(problems):
            prompt = question(p, rng)
            chat = tool_chat(p, prompt) if calls.random() < self.tool_share else direct_chat(p, prompt)
            out.append(SFTExample(chat, meta={"level": p.level, "tool": chat[1].content.startswith("<tool_call>")},
                                  origin=f"{NAME}[{i}]"))
        return out

    def tokenizer_texts(self) -> list[str]:
        """Both kinds of demonstration as plain text (half call the tool, so the call's JSON gets merges)."""
        rng = random.Random(f"{self._seed}-tools-tokenizer")
        texts = []
        for i, p in enumerate(self.world.train_problems(2000, stream="tokenizer")):
            chat = tool_chat(p, question(p, rng)) if i % 2 else direct_chat(p, question(p, rng))
            texts.append("\n".join(f"{m.role}\n{m.content}" for m in chat))
        return texts

    # ---- the environment -------------------------------------------------------------------------
    def environment(self, **params: Any) -> EnvironmentFactory:
        """The `tools` environment with the calculator and no system prompt; `params` override those
        defaults (and take any other `tools` parameter, e.g. max_calls)."""
        return build_environment("tools", **{**DEFAULT_ENV, **params})

    # ---- judges ----------------------------------------------------------------------------------
    def eval_problems(self, level: str | None) -> list[Problem]:
        if level not in LEVELS:
            raise TaskError(f"task {NAME!r}: unknown level {level!r}; expected one of {list(LEVELS)}")
        return [as_problem(p, eval_question(p), f"{NAME}.eval[{level}][{i}]")
                for i, p in enumerate(self.world.eval_problems[level])]

    def judge(self, problems: Sequence[Problem], texts: Sequence[str], finish: Sequence[str]) -> list[bool]:
        """A final answer turn: it ended (`stop`) and its final integer is the answer."""
        return [r == "stop" and parse_answer(t) == int(str(p.answer)) for p, t, r in zip(problems, texts, finish)]

    def gold_rewards(self, problems: Sequence[Problem], texts: Sequence[str], finish: Sequence[str]) -> list[float | None]:
        """The arithmetic world's graded judge on the final answer; 0 for one that never ended."""
        return [None if p.answer is None else (gold_reward(_Value(int(str(p.answer))), t) if r == "stop" else 0.0)
                for p, t, r in zip(problems, texts, finish)]

    # ---- the eval --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: Any, tok: Any, request: EvalRequest, *, stage: str, checkpoint: str,
                 phase: PhaseFn | None = None) -> list[EvalRecord]:
        """Greedy episodes in the task's environment, per level and pooled: `exact_match` and
        `tool_use`. Each turn answers in at most `max_new_tokens`; an episode has at most 3 turns and
        the model's context. Sampled pass@k over episodes is not built (an error, not a silent skip)."""
        return evaluate_episodes(self, model, tok, request, stage=stage, checkpoint=checkpoint, phase=phase,
                                 metric="exact_match", correct=episode_correct, turns=EVAL_TURNS)


class _Value:
    """What `gold_reward` reads of a problem: its value."""

    def __init__(self, value: int):
        self.value = value
