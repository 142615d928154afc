"""Run untrusted, model-written code under OS-level isolation, and judge it from outside.

`open_sandbox()` gives a pool on the bubblewrap backend (or refuses, saying why); `judge_programs`
runs a batch of programs against their tests and returns one `Verdict` each. Verdicts are decided in
this process from plain data; the candidate's exit code and what it prints about itself are not
evidence. Threat model and guarantees: docs/sandbox.md.
"""

from posttrain.sandbox.bubblewrap import BubblewrapSandbox, HostSupport, SandboxUnavailable
from posttrain.sandbox.execution import Execution, Job, Limits
from posttrain.sandbox.judge import CallTest, IOTest, Status, Verdict, judge_calls, judge_stdio, parse_assert
from posttrain.sandbox.pool import (BACKENDS, SandboxPool, combine_cases, judge_programs, open_sandbox,
                                    parse_tests)
from posttrain.sandbox.unsafe import UnsafeSandboxWarning, UnsafeSubprocessSandbox

__all__ = [
    "BACKENDS", "BubblewrapSandbox", "CallTest", "Execution", "HostSupport", "IOTest", "Job", "Limits",
    "SandboxPool", "SandboxUnavailable", "Status", "UnsafeSandboxWarning", "UnsafeSubprocessSandbox",
    "Verdict", "combine_cases", "judge_calls", "judge_programs", "judge_stdio", "open_sandbox",
    "parse_assert", "parse_tests",
]
