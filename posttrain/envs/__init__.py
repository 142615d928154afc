"""Multi-turn environments and tools: episodes where the model writes, the environment answers.

    factory = build_environment("tools", tools=["calculator", "python"])
    run = run_episodes(engine, tokenizer, factory, problems, budget=Budget(max_turns=4, max_tokens=512))
    batch = pad_episodes(run.episodes, engine.pad_id)   # loss mask: the model's tokens only

Modules: `base` (the Environment protocol, StepResult, Budget), `tool_calls` (the call format and its
parser, which never raises), `tools` (calculator, Python in the sandbox, the capped executor),
`tool_env` (ToolEnv), `transcript` (an episode as one token sequence through the chat template),
`episodes` (the batched multi-turn loop over a RolloutEngine), `registry` (names → factories).
Format, budgets, caps and what is not built yet: docs/envs.md.
"""

from posttrain.envs.base import Budget, EnvFactory, Environment, StepResult
from posttrain.envs.episodes import Episode, EpisodeBatch, EpisodeEnd, EpisodeRun, pad_episodes, run_episodes
from posttrain.envs.registry import EnvironmentConfigError, EnvironmentFactory, EnvName, build_environment
from posttrain.envs.tool_calls import CallError, ParsedTurn, ToolCall, format_call, parse_tool_calls
from posttrain.envs.tool_env import ToolEnv, tools_system_prompt
from posttrain.envs.tools import Calculator, CalculatorError, PythonSessionTool, PythonTool, Tool, ToolResult, calculate, run_calls

__all__ = [
    "Budget", "CallError", "Calculator", "CalculatorError", "EnvFactory", "EnvName", "Environment",
    "EnvironmentConfigError", "EnvironmentFactory", "Episode", "EpisodeBatch", "EpisodeEnd", "EpisodeRun",
    "ParsedTurn", "PythonSessionTool", "PythonTool", "StepResult", "Tool", "ToolCall", "ToolEnv", "ToolResult", "build_environment",
    "calculate", "format_call", "pad_episodes", "parse_tool_calls", "run_calls", "run_episodes",
    "tools_system_prompt",
]
