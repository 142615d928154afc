"""The parent-side judge: assert parsing, decoding plain data, verdict rules. No sandbox needed."""

from __future__ import annotations

import math

import pytest

from posttrain.sandbox.execution import Execution, parse_records
from posttrain.sandbox.judge import (
    CallTest,
    Status,
    Verdict,
    decode,
    judge_calls,
    judge_stdio,
    matches,
    normalize_output,
    parse_assert,
)
from posttrain.sandbox.pool import combine_cases, parse_tests

# ---- parse_assert ---------------------------------------------------------------------------------

def test_parse_equality_either_side():
    t = parse_assert("assert f(1, 'a') == [1, (2, 3)]")
    assert (t.call, t.expected, t.op) == ("f(1, 'a')", [1, (2, 3)], "==")
    t = parse_assert("assert {'k': None} == g(x=2), 'message ignored'")
    assert (t.call, t.expected, t.op) == ("g(x=2)", {"k": None}, "==")


def test_parse_mirrors_order_comparisons():
    # 3 < f(x)  ≡  f(x) > 3
    t = parse_assert("assert 3 < f(x)")
    assert (t.call, t.expected, t.op) == ("f(x)", 3, ">")


def test_parse_set_wrappers_and_isclose_and_truthiness():
    t = parse_assert("assert set(f([1, 1, 2])) == set([1, 2])")
    assert (t.call, t.expected) == ("set(f([1, 1, 2]))", {1, 2})
    t = parse_assert("assert math.isclose(area(2), 12.566, rel_tol=0.001)")
    assert (t.call, t.expected, t.op, t.rel_tol, t.abs_tol) == ("area(2)", 12.566, "isclose", 0.001, 0.0)
    assert (parse_assert("assert is_ok(3)").op, parse_assert("assert not is_ok(4)").op) == ("truthy", "falsy")
    assert parse_assert("assert f() is None").op == "is"


@pytest.mark.parametrize("bad, words", [
    ("f(1) == 2", "exactly one `assert`"),
    ("assert f(1) == g(2)", "must be a Python literal"),
    ("assert 0 < f(1) < 3", "single comparison"),
    ("assert f() is 3", "`is` only against"),
    ("assert isclose(f(1), 2, tol=3)", "unknown isclose arguments"),
    ("assert (", "not valid Python"),
    ("assert f(1) == 2 or f(1) == 3", "unsupported assert shape"),
])
def test_parse_rejects_unsupported_shapes_with_the_assert_named(bad, words):
    with pytest.raises(ValueError, match=words) as e:
        parse_assert(bad)
    assert repr(bad) in str(e.value)


def test_parse_tests_kinds_and_errors():
    assert [t.call for t in parse_tests(["assert f(1) == 1"])] == ["f(1)"]
    io = parse_tests([{"stdin": "1\n", "stdout": "2\n"}])
    assert (io[0].stdin, io[0].stdout) == ("1\n", "2\n")
    with pytest.raises(ValueError, match=r"tests\[1\]"):
        parse_tests([{"stdin": "1", "stdout": "2"}, {"stdin": "1"}])
    with pytest.raises(ValueError, match="no tests"):
        parse_tests([])


# ---- decode / matches -----------------------------------------------------------------------------

def test_decode_rebuilds_exact_builtin_types():
    data = {"dict": [["a", {"tuple": [1, 2.5, {"float": "nan"}]}], [3, {"set": [1]}],
                     [{"tuple": [1]}, {"bytes": "6869"}]]}
    value = decode(data)
    assert value["a"][:2] == (1, 2.5) and math.isnan(value["a"][2])
    assert value[3] == {1} and value[(1,)] == b"hi"  # 0x68 0x69 = "hi"


@pytest.mark.parametrize("data", [{"object": 1}, {"tuple": [1], "x": 2}, {"dict": [[[1], 2]]},
                                  {"float": "1e999"}, {"bytes": "zz"}])
def test_decode_refuses_anything_else(data):
    with pytest.raises(ValueError):
        decode(data)


def test_matches_uses_python_semantics_on_plain_values():
    assert matches([1, 2], CallTest("f()", [1, 2]))
    assert not matches([1, 2], CallTest("f()", (1, 2)))  # list ≠ tuple, as in the assert
    assert matches(1.0, CallTest("f()", 1))  # 1.0 == 1 in Python
    assert matches(3.1416, CallTest("f()", 3.14159, op="isclose", rel_tol=1e-4))  # |Δ|/3.14 = 3e-6
    assert not matches(3.15, CallTest("f()", 3.14159, op="isclose", rel_tol=1e-4))  # 2.7e-3 > 1e-4
    assert not matches(None, CallTest("f()", 3, op="<"))  # None < 3 raises → the assert fails
    assert not matches(0, CallTest("f()", None, op="truthy"))
    assert not matches(1, CallTest("f()", True, op="is"))  # 1 is not True


# ---- verdict rules --------------------------------------------------------------------------------

def execution(lines: list[bytes], **kw) -> Execution:
    ex = Execution(**kw)
    parse_records(b"\n".join(lines) + b"\n", ex)
    return ex


STARTED = b'{"started":true}'
DONE = b'{"done":true}'


def test_no_started_record_is_a_sandbox_error_with_reward_none():
    v = judge_calls(execution([b'{"i":0,"value":2}', DONE], error="bwrap: boom"), [CallTest("f()", 2)])
    assert v.status is Status.SANDBOX_ERROR and v.reward is None


def test_started_must_be_the_exact_first_line():
    ex = execution([b'junk' + STARTED, b'{"i":0,"value":2}', DONE])
    assert not ex.started


def test_calls_pass_fail_and_missing():
    tests = [CallTest("f(1)", 2), CallTest("f(2)", 4)]
    ok = execution([STARTED, b'{"i":0,"value":2}', b'{"i":1,"value":4}', DONE])
    assert judge_calls(ok, tests).status is Status.PASS
    wrong = execution([STARTED, b'{"i":0,"value":2}', b'{"i":1,"value":5}', DONE])
    v = judge_calls(wrong, tests)
    assert (v.status, v.passed, v.reward) == (Status.FAIL, 1, 0.0)
    # one record, then the process vanished (os._exit): not all tests reported → runtime error
    gone = execution([STARTED, b'{"i":0,"value":2}'], exit_code=0)
    assert judge_calls(gone, tests).status is Status.RUNTIME_ERROR


def test_duplicate_or_garbage_records_fail():
    tests = [CallTest("f(1)", 2)]
    dup = execution([STARTED, b'{"i":0,"value":2}', b'{"i":0,"value":2}', DONE])
    assert judge_calls(dup, tests).status is Status.FAIL
    garbage = execution([STARTED, b'{"i":0,"value":2}', b'PASS', DONE])
    assert judge_calls(garbage, tests).status is Status.FAIL


def test_limits_take_priority_and_timeout_after_done_is_ignored():
    tests = [CallTest("f(1)", 2)]
    assert judge_calls(execution([STARTED], timed_out=True), tests).status is Status.TIMEOUT
    late = execution([STARTED, b'{"i":0,"value":2}', DONE], timed_out=True)
    assert judge_calls(late, tests).status is Status.PASS
    flood = execution([STARTED, b'{"i":0,"value":2}', DONE], output_exceeded="stdout")
    assert judge_calls(flood, tests).status is Status.OUTPUT_LIMIT
    assert judge_calls(execution([STARTED, b'{"memory":true}', DONE]), tests).status is Status.MEMORY


def test_stdio_output_comparison():
    ok = dict(lines=[STARTED, b'{"exit":0}', DONE])
    assert judge_stdio(execution(**ok, stdout=b"1\n2  \n\n"), "1\n2\n").status is Status.PASS
    assert judge_stdio(execution(**ok, stdout=b"1\r\n2\r\n"), "1\n2\n").status is Status.PASS
    assert judge_stdio(execution(**ok, stdout=b"1\n"), "1\n2\n").status is Status.FAIL  # first line only
    assert judge_stdio(execution(**ok, stdout=b"1\n2\nx\n"), "1\n2\n").status is Status.FAIL  # + junk
    assert judge_stdio(execution(**ok, stdout=b" 1\n2\n"), "1\n2\n").status is Status.FAIL  # leading space
    bad_exit = execution([STARTED, b'{"exit":3}', DONE], stdout=b"1\n2\n")
    assert judge_stdio(bad_exit, "1\n2\n").status is Status.RUNTIME_ERROR
    assert normalize_output("a \nb\n\n") == "a\nb"


def test_combine_cases_prefers_a_definite_failure_over_a_sandbox_error():
    p, f, s = (Verdict(Status.PASS, 1, 1), Verdict(Status.FAIL, 0, 1), Verdict(Status.SANDBOX_ERROR, 0, 1))
    assert combine_cases([p, s, f]).status is Status.FAIL
    assert combine_cases([p, s]).status is Status.SANDBOX_ERROR
    v = combine_cases([p, p])
    assert (v.status, v.passed, v.total) == (Status.PASS, 2, 2)
