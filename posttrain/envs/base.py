"""The environment contract: what an environment is, what one step returns, and an episode's budget.

An environment is a plain Python object that holds one episode's state:

    env = factory()                        # one fresh environment per episode
    messages = env.reset(problem)          # the chat the model starts from (system, user, …)
    result = env.step(assistant_text)      # the model's turn → StepResult(new_messages, reward, done)

`step` is called once per assistant turn with that turn's text (special tokens skipped). It answers
with the messages the environment adds to the chat (tool results, feedback; usually `tool` or `user`
role), a reward for this step or None (no reward at this step — not "cannot judge"), and whether the
episode is over. It must not raise on anything the model wrote: a malformed tool call is answered with
an error message (and counted in `tool_errors`), never an exception.

The episode's limits are the rollout's, not the environment's (`Budget`): the episode loop
(`envs.episodes`) stops an episode at its turn or token budget whatever the environment says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from posttrain.data.records import Message, Problem


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one assistant turn."""

    new_messages: list[Message] = field(default_factory=list)  # appended to the chat (never trained on)
    reward: float | None = None  # this step's reward; None: no reward at this step
    done: bool = False           # the episode is over (no further turn is generated)
    tool_calls: int = 0          # tool calls in the turn that parsed and ran (whatever their result)
    tool_errors: int = 0         # malformed calls, unknown tools, tools that failed, timed out or were capped
    hidden_probes: int = 0       # the turn's programs' attempts to read what they were not given (tests, frames, env)


@runtime_checkable
class Environment(Protocol):
    def reset(self, problem: Problem) -> list[Message]:
        """Start an episode on `problem`; the messages the model's first turn answers."""
        ...

    def step(self, assistant_message: str) -> StepResult:
        """The model's turn (its text) → what the environment adds, a reward or None, and done."""
        ...


def close_environment(env: Environment) -> None:
    """End what one episode's environment holds (a Python session), if it holds anything: the episode
    loop calls it when the episode ends, whatever ended it."""
    close = getattr(env, "close", None)
    if close is not None:
        close()


EnvFactory = Callable[[], Environment]  # a fresh environment per episode (environments hold state)


@dataclass(frozen=True)
class Budget:
    """Per-episode limits, enforced by the episode loop (not by the environment).

    The token budget counts the whole episode sequence — the first prompt, every model turn and
    everything the environment wrote — because that is what the model attends to and the update
    forwards; one turn generates at most `turn_tokens`, and never past the episode's budget."""

    max_turns: int = 4        # assistant turns; the episode ends after this many whatever the env says
    max_tokens: int = 512     # tokens of the whole episode sequence (prompt + model + environment)
    turn_tokens: int = 64     # max new tokens of one assistant turn

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "turn_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Budget.{name} must be >= 1, got {getattr(self, name)}")


class EnvironmentConfigError(ValueError):
    """An unknown environment, tool or parameter in a recipe: a configuration error."""


class EnvironmentFactory:
    """Makes one environment per episode; owns what they share (tools); `close()` releases it."""

    def __init__(self, make: Callable[[], Environment], tools: Sequence[Any] = (),
                 validate: Callable[[Sequence[Problem]], None] | None = None):
        self._make, self.tools, self._validate = make, list(tools), validate

    def __call__(self) -> Environment:
        return self._make()

    def validate(self, problems: Sequence[Problem]) -> None:
        """Check the problems this environment will be played on before anything runs (a code
        problem needs its visible and hidden tests): ValueError naming the problem and the field."""
        if self._validate is not None:
            self._validate(problems)

    def close(self) -> None:
        for tool in self.tools:
            close = getattr(tool, "close", None)
            if close is not None:
                close()
