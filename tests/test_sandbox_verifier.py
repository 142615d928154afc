"""The `code` verifier end to end on the code world, and the explicit unsafe backend."""

from __future__ import annotations

import warnings

import pytest

from posttrain.rewards.code import CodeVerifier, extract_program
from posttrain.sandbox import (
    Limits,
    SandboxUnavailable,
    Status,
    UnsafeSandboxWarning,
    judge_programs,
    open_sandbox,
    parse_tests,
)
from posttrain.worlds.code import code_problems, problem_rows

LIMITS = Limits(timeout_s=3.0, output_bytes=64 << 10)


@pytest.fixture(scope="module")
def verifier():
    try:
        v = CodeVerifier(limits=LIMITS, concurrency=2)
    except SandboxUnavailable as e:
        pytest.fail(f"bubblewrap sandbox unavailable here: {e}")
    yield v
    v.close()


def test_extract_program():
    assert extract_program("Sure:\n```python\nx = 1\n```\nDone.") == "x = 1"
    assert extract_program("```py\na\n```\ntext\n```python\nb = 2\n```") == "b = 2"  # the last block
    assert extract_program("```\nbare\n```") == "bare"
    assert extract_program("```python\ncut off mid-gen") == "cut off mid-gen"  # unterminated fence
    assert extract_program("def f():\n    return 1") == "def f():\n    return 1"  # no fence: all
    assert extract_program("```bash\nls\n```") == "```bash\nls\n```"  # not Python: no block taken


def test_every_reference_solution_passes_and_wrong_ones_fail(verifier):
    rows = problem_rows()
    assert {r["level"] for r in rows} == {"function", "stdio"} and len(rows) == 12
    good = [p.reference_completion() for p in code_problems()]
    # a wrong answer per problem: the entry point returning None (stdio: a `main` never called,
    # i.e. a program that prints nothing)
    bad = ["```python\ndef " + (r["entry_point"] or "main") + "(*a):\n    return None\n```" for r in rows]
    rewards = verifier(good + bad, tests=[r["tests"] for r in rows] * 2)
    assert rewards == [1.0] * 12 + [0.0] * 12
    verdicts = verifier.verdicts(good[:1], tests=[rows[0]["tests"]])
    assert (verdicts[0].status, verdicts[0].passed, verdicts[0].total) == (Status.PASS, 4, 4)


def test_partial_credit_is_the_fraction_passed():
    tests = ["assert f(1) == 1", "assert f(2) == 4", "assert f(3) == 9", "assert f(4) == 15"]
    with open_sandbox(limits=LIMITS, concurrency=2) as pool:
        v = CodeVerifier(pool, partial_credit=True)
        # x*x passes 3 of the 4 (the last expects 15, not 16): 3/4 = 0.75
        assert v(["def f(x):\n    return x * x"], tests=[tests]) == [0.75]
        v.partial_credit = False
        assert v(["def f(x):\n    return x * x"], tests=[tests]) == [0.0]


def test_test_setup_runs_before_the_program(verifier):
    rewards = verifier(["def g():\n    return CONST * 2"], tests=[["assert g() == 14"]],
                       test_setup=["CONST = 7"])
    assert rewards == [1.0]  # 7 * 2 = 14


def test_bad_columns_are_named(verifier):
    with pytest.raises(ValueError, match="needs a `tests` column"):
        verifier(["x"], answer=["1"])
    with pytest.raises(ValueError, match=r"one entry per completion \(2\), got 1"):
        verifier(["a", "b"], tests=[["assert f() == 1"]])
    with pytest.raises(ValueError, match=r"tests\[0\]"):
        verifier(["a"], tests=[[{"stdin": "1"}]])
    with pytest.raises(ValueError, match=r"tests\[0\] must be a list"):
        verifier(["a"], tests=["assert f() == 1"])


def test_sandbox_error_is_none_not_zero(verifier, monkeypatch):
    monkeypatch.setattr(verifier.pool.backend, "python", "/nonexistent/python3")
    rewards = verifier(["def f():\n    return 1", "def f():\n    return 2"],
                       tests=[["assert f() == 1"], [{"stdin": "", "stdout": "x"}]])
    assert rewards == [None, None]


def test_unsafe_backend_must_be_named_and_warns_every_time():
    with pytest.raises(ValueError, match="not one of"):
        open_sandbox("subprocess")
    with pytest.warns(UnsafeSandboxWarning):
        pool = open_sandbox("unsafe-subprocess", limits=LIMITS, concurrency=1)
    with pool:
        tests = parse_tests(["assert add(1, 2) == 3"])
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught:
                verdicts = judge_programs(pool, [("def add(a, b):\n    return a + b", tests, ""),
                                                 ("def add(a, b):\n    return a * b", tests, "")])
            assert [w.category for w in caught] == [UnsafeSandboxWarning]  # once per batch, each batch
            assert [v.status for v in verdicts] == [Status.PASS, Status.FAIL]
        # stdout flushed just before the end is not lost when the backend kills the group at `done`
        with pytest.warns(UnsafeSandboxWarning):
            big = parse_tests([{"stdin": "", "stdout": "x" * 100000}])
            io = judge_programs(pool, [("print('x' * 100000)", big, "")],
                                Limits(timeout_s=3.0, output_bytes=1 << 20))
        assert io[0].status is Status.PASS
        # its timeout still holds (a process-group kill) — the one guarantee it keeps
        with pytest.warns(UnsafeSandboxWarning):
            slow = judge_programs(pool, [("while True:\n    pass", parse_tests([{"stdin": "", "stdout": ""}]),
                                          "")], Limits(timeout_s=1.0))
        assert slow[0].status is Status.TIMEOUT and slow[0].elapsed_s < 2.5
