"""Multi-turn environments and tools: episodes where the model writes, the environment answers.

    factory = build_environment("tools", tools=["calculator", "python"])
    env = factory(); messages = env.reset(problem); result = env.step(assistant_text)

Modules: `base` (the Environment protocol, StepResult, Budget), `tool_calls` (the call format and its
parser, which never raises), `tools` (calculator, Python in the sandbox, the capped executor),
`tool_env` (ToolEnv), `registry` (names → factories).
Format, budgets, caps and what is not built yet: docs/envs.md.
"""

from posttrain.envs.base import Budget, EnvFactory, Environment, StepResult
from posttrain.envs.registry import EnvironmentConfigError, EnvironmentFactory, EnvName, build_environment
from posttrain.envs.tool_calls import CallError, ParsedTurn, ToolCall, format_call, parse_tool_calls
from posttrain.envs.tool_env import ToolEnv, tools_system_prompt
from posttrain.envs.tools import Calculator, CalculatorError, PythonTool, Tool, ToolResult, calculate, run_calls

__all__ = [
    "Budget", "CallError", "Calculator", "CalculatorError", "EnvFactory", "EnvName", "Environment",
    "EnvironmentConfigError", "EnvironmentFactory",
    "ParsedTurn", "PythonTool", "StepResult", "Tool", "ToolCall", "ToolEnv", "ToolResult", "build_environment",
    "calculate", "format_call", "parse_tool_calls", "run_calls",
    "tools_system_prompt",
]
