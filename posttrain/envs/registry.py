"""The environment registry: the names a recipe gives environments, and how each is built.

``build_environment("tools", tools=["calculator"])`` checks the parameters against the builder's
signature (unknown ones are an `EnvironmentConfigError` naming them, as the verifier registry
does) and returns an `EnvironmentFactory`: call it for a fresh environment per episode, `close()` it
when the stage ends (the Python tool holds a sandbox pool).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

from posttrain.envs.base import EnvironmentConfigError, EnvironmentFactory
from posttrain.envs.code_env import build_code_environment
from posttrain.envs.tool_env import ToolEnv
from posttrain.envs.tools import (BUILTIN_TOOLS, DEFAULT_PYTHON_LIMITS, MAX_RESULT_CHARS, Calculator, PythonSessionTool,
                                  PythonTool, Tool)
from posttrain.sandbox import Limits
from posttrain.sandbox.session import SessionHost


class EnvName(str, Enum):
    """Names a recipe can use for environments."""

    TOOLS = "tools"  # call tools (calculator, python in the sandbox) until a turn without a call answers
    CODE = "code"    # write a function, run it against visible tests, answer; hidden tests decide (envs/code_env.py)


def _build_tools(*, tools: Sequence[str] = ("calculator",), max_calls: int = 4,
                 max_result_chars: int = MAX_RESULT_CHARS, python_limits: dict[str, Any] | None = None,
                 sandbox: str = "bubblewrap", system_prompt: bool = True,
                 python_session: bool = False) -> EnvironmentFactory:
    built: dict[str, Tool] = {}
    host: SessionHost | None = None
    for name in tools:
        if name not in BUILTIN_TOOLS:
            raise EnvironmentConfigError(f"environment 'tools': unknown tool {name!r}; expected some of: "
                                         f"{', '.join(BUILTIN_TOOLS)}")
        limits = DEFAULT_PYTHON_LIMITS if python_limits is None else Limits(**python_limits)
        if name == "python" and python_session:
            host = SessionHost(sandbox, limits)  # the session itself is made per episode, below
        elif name == "python":
            built[name] = PythonTool(backend=sandbox, limits=limits)
        else:
            built[name] = Calculator()
    if not built and host is None:
        raise EnvironmentConfigError("environment 'tools': `tools` is empty; name at least one tool")
    if python_session and host is None:
        raise EnvironmentConfigError("environment 'tools': python_session is set but `tools` has no 'python'")
    if max_calls < 1 or max_result_chars < 1:
        raise EnvironmentConfigError("environment 'tools': max_calls and max_result_chars must be >= 1")

    def make() -> ToolEnv:
        tools_now = dict(built)
        if host is not None:
            tools_now["python"] = PythonSessionTool(host)  # a fresh interpreter per episode
        return ToolEnv(tools_now, max_calls=max_calls, max_result_chars=max_result_chars,
                       system_prompt=system_prompt, episode_tools=("python",) if host is not None else ())

    return EnvironmentFactory(make, [*built.values(), *([host] if host is not None else [])])


_BUILDERS: dict[EnvName, Callable[..., EnvironmentFactory]] = {EnvName.TOOLS: _build_tools,
                                                                 EnvName.CODE: build_code_environment}


def build_environment(name: str, **params: Any) -> EnvironmentFactory:
    """Build the named environment's factory with its recipe parameters; unknown names/parameters are errors."""
    try:
        key = EnvName(name)
    except ValueError:
        raise EnvironmentConfigError(f"unknown environment {name!r}; expected one of: "
                                     f"{', '.join(e.value for e in EnvName)}") from None
    signature = inspect.signature(_BUILDERS[key])
    for param in params:
        if param not in signature.parameters:
            raise EnvironmentConfigError(f"environment {key.value!r}: unknown parameter {param!r}; expected one of: "
                                         f"{', '.join(signature.parameters)}")
    return _BUILDERS[key](**params)
