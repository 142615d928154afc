"""The Python tool runs in the bubblewrap sandbox: a hang is a timeout message, a 10 MB result is
capped, the host's files cannot be read, and none of it raises or reaches past the tool."""

from __future__ import annotations

import time

import pytest

from posttrain.envs import PythonTool, ToolEnv, format_call, parse_tool_calls, run_calls
from posttrain.sandbox import Limits, SandboxUnavailable, open_sandbox

TIMEOUT = 2.0
LIMITS = Limits(timeout_s=TIMEOUT, memory_bytes=512 << 20, output_bytes=64 << 10, processes=8)


@pytest.fixture(scope="module")
def python_tool():
    try:
        pool = open_sandbox("bubblewrap", limits=LIMITS, concurrency=2)
    except SandboxUnavailable as e:  # the sandbox is what makes the tool safe: no silent skip
        pytest.fail(f"bubblewrap sandbox unavailable here: {e}")
    yield PythonTool(limits=LIMITS, pool=pool)
    pool.close()


def test_a_program_prints_its_result(python_tool):
    (r,) = python_tool.run([{"code": "print(sum(range(101)))"}])
    assert (r.content, r.error) == ("5050\n", False)   # 0 + 1 + … + 100 = 5050


def test_an_exception_comes_back_as_an_error_after_the_output(python_tool):
    (r,) = python_tool.run([{"code": "print('before')\n1 / 0"}])
    assert r.error and r.content.startswith("before\n") and "ZeroDivisionError" in r.content


def test_a_program_that_hangs_is_stopped_at_the_timeout(python_tool):
    t0 = time.monotonic()
    (r,) = python_tool.run([{"code": "while True:\n    pass"}])
    elapsed = time.monotonic() - t0
    assert r.error and f"timed out after {TIMEOUT:g} s" in r.content
    assert TIMEOUT <= elapsed < TIMEOUT + 8  # killed from outside (slack for a loaded 2-core host)


def test_a_10_mb_result_is_capped(python_tool):
    text = format_call("python", {"code": "import sys\nsys.stdout.write('x' * 10_000_000)"})
    (r,) = run_calls(parse_tool_calls(text), {"python": python_tool}, max_chars=2000)
    # the sandbox stops reading at 64 KiB and kills the program; the chat gets 2,000 characters and a note
    assert r.error and len(r.content) < 2100 and r.content.startswith("x" * 1000) and "truncated" in r.content


def test_a_program_cannot_read_the_hosts_files(python_tool, tmp_path):
    # the hidden tests of a code task, as a file on the host; /home and /etc are not mounted either
    # (of /root only the interpreter's prefix is, read-only: docs/sandbox.md)
    hidden = tmp_path / "hidden_tests.py"
    hidden.write_text("assert solve(3) == 'SECRET-7f3a'\n")
    code = (f"import os\nfor k, p in enumerate([{str(hidden)!r}, {str(tmp_path)!r}, '/home', '/etc/passwd']):\n"
            "    try:\n        print(k, os.listdir(p) if os.path.isdir(p) else open(p).read())\n"
            "    except Exception as e:\n        print(k, type(e).__name__)\n")
    (r,) = python_tool.run([{"code": code}])
    assert "SECRET" not in r.content and "hidden_tests" not in r.content
    assert r.content == "".join(f"{k} FileNotFoundError\n" for k in range(4)), r.content


def test_bad_arguments_and_several_programs_in_one_turn(python_tool):
    got = python_tool.run([{"code": "print(1)"}, {"source": "print(2)"}, {"code": "print(3)"}])
    assert [r.content for r in got] == ["1\n", 'error: python takes exactly {"code": "<program>"}', "3\n"]
    assert [r.error for r in got] == [False, True, False]


def test_each_call_is_a_fresh_process(python_tool):
    a, b = python_tool.run([{"code": "x = 41\nprint(x + 1)"}, {"code": "print(x)"}])
    assert a.content == "42\n" and b.error and "NameError" in b.content


def test_a_tool_env_turn_with_a_hang_a_flood_and_a_bad_call_returns_counted_errors(python_tool):
    env = ToolEnv({"python": python_tool})
    text = (format_call("python", {"code": "import time\ntime.sleep(60)"})
            + format_call("python", {"code": "print('y' * 10_000_000)"})
            + "<tool_call>{not json}</tool_call>" + format_call("python", {"code": "print(6 * 7)"}))
    r = env.step(text)
    assert not r.done and r.tool_calls == 3 and r.tool_errors == 3
    assert [m.content.split("\n")[-1][:20] for m in r.new_messages][2:] == ["error: tool call 3 i", ""]
    assert r.new_messages[3].content == "42\n"
