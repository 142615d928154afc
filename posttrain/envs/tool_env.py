"""`ToolEnv`: the model may call tools before it answers; a turn without a call is its answer.

    reset(problem) → [system: the tools and the call format] + the problem's prompt
    step(text)     → calls found: one `tool` message per call, not done
                     no call:     done, reward = score(problem, text) (None without a scorer)

The final answer is usually judged by the stage's verifiers on the episode's last assistant turn
(the same verifiers as single-turn RLVR); `score` is for an environment that judges it itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from posttrain.data.records import Message, Problem, prompt_messages
from posttrain.envs.base import StepResult
from posttrain.envs.tool_calls import ToolCall, format_call, parse_tool_calls
from posttrain.envs.tools import MAX_RESULT_CHARS, Tool, run_calls

Score = Callable[[Problem, str], "float | None"]


def tools_system_prompt(tools: dict[str, Tool]) -> str:
    """The system message that tells the model its tools and the call format."""
    lines = [f"- {t.name}: {t.description}" for t in tools.values()]
    example = format_call("calculator", {"expression": "2 + 2"}) if "calculator" in tools else \
        format_call(next(iter(tools)), {})
    return ("You may call tools before you answer. Tools:\n" + "\n".join(lines)
            + f"\nTo call one, write {example} and end your turn; the result comes back as a tool message. "
              "A turn without a tool call is your final answer.")


class ToolEnv:
    def __init__(self, tools: dict[str, Tool], *, score: Score | None = None, max_calls: int = 4,
                 max_result_chars: int = MAX_RESULT_CHARS, system_prompt: bool = True,
                 episode_tools: Sequence[str] = ()):
        if not tools:
            raise ValueError("ToolEnv needs at least one tool")
        self.tools, self.score = tools, score
        self.episode_tools = tuple(episode_tools)  # tools made for this episode alone: `close()` ends them
        self.max_calls, self.max_result_chars, self.system_prompt = max_calls, max_result_chars, system_prompt
        self.problem: Problem | None = None

    def reset(self, problem: Problem) -> list[Message]:
        self.problem = problem
        messages = prompt_messages(problem.prompt)
        if self.system_prompt and not (messages and messages[0].role == "system"):
            messages = [Message("system", tools_system_prompt(self.tools))] + messages
        return messages

    def step(self, assistant_message: str) -> StepResult:
        parsed = parse_tool_calls(assistant_message, max_calls=self.max_calls)
        if not parsed.has_calls:
            reward = None if self.score is None or self.problem is None else self.score(self.problem, assistant_message)
            return StepResult([], reward, done=True)
        results = run_calls(parsed, self.tools, max_chars=self.max_result_chars)
        ran = sum(isinstance(i, ToolCall) and i.name in self.tools for i in parsed.items)
        return StepResult([Message("tool", r.content) for r in results], None, done=False,
                          tool_calls=ran, tool_errors=sum(r.error for r in results),
                          hidden_probes=sum(r.probes for r in results))

    def close(self) -> None:
        """End this episode's own tools (a Python session); shared tools are the factory's to close."""
        for name in self.episode_tools:
            close = getattr(self.tools[name], "close", None)
            if close is not None:
                close()
