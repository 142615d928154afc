"""Tool calls: the parser never raises, the calculator never evaluates code, results are capped, and
a turn's calls run through one executor that answers every mistake with a counted error message."""

from __future__ import annotations

import json
import re

import pytest

from posttrain.data.records import Message, Problem
from posttrain.envs import (
    Calculator,
    CalculatorError,
    CallError,
    ToolCall,
    ToolEnv,
    ToolResult,
    build_environment,
    calculate,
    format_call,
    parse_tool_calls,
    run_calls,
)
from posttrain.envs.registry import EnvironmentConfigError
from posttrain.envs.tool_calls import MAX_BODY_CHARS


# ---- the parser ----------------------------------------------------------------------------------
def test_a_well_formed_call_round_trips():
    text = "Let me compute. " + format_call("calculator", {"expression": "12 * 34"}) + " ok"
    assert parse_tool_calls(text).items == [ToolCall("calculator", {"expression": "12 * 34"})]


def test_text_without_a_tag_has_no_calls():
    parsed = parse_tool_calls("The answer is 408.")
    assert not parsed.has_calls and parsed.errors == 0


@pytest.mark.parametrize("body, says", [
    ("{bad json", "no closing"),                                  # unclosed tag (the whole rest is the body)
    ("{bad json}</tool_call>", "not valid JSON"),
    ("[1, 2]</tool_call>", "must be a JSON object"),
    ('{"arguments": {}}</tool_call>', 'no "name"'),
    ('{"name": 3, "arguments": {}}</tool_call>', 'no "name"'),
    ('{"name": "calculator", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
    ("[" * 100_000 + "]" * 100_000 + "</tool_call>", "characters long"),   # refused before parsing
    ("[" * 3_000 + "</tool_call>", "not valid JSON"),
    ('{"name": "x", "arguments": {}}' + " " * MAX_BODY_CHARS + "</tool_call>", "characters long"),
])
def test_malformed_calls_become_error_messages_never_exceptions(body, says):
    parsed = parse_tool_calls("<tool_call>" + body)
    assert len(parsed.items) == 1 and isinstance(parsed.items[0], CallError), parsed
    assert says in parsed.items[0].message and parsed.errors == 1


def test_deep_nesting_within_the_length_cap_does_not_raise():
    # 2,000 nested lists fit in MAX_BODY_CHARS (4,096); json's C parser recurses on them
    parsed = parse_tool_calls("<tool_call>" + "[" * 2_000 + "]" * 2_000 + "</tool_call>")
    assert parsed.errors == 1


def test_more_calls_than_the_turn_allows_are_cut_with_one_error():
    call = format_call("calculator", {"expression": "1 + 1"})
    parsed = parse_tool_calls(call * 6, max_calls=4)
    assert [type(i).__name__ for i in parsed.items] == ["ToolCall"] * 4 + ["CallError"]
    assert "more than 4" in parsed.items[-1].message


def test_calls_keep_their_order_with_errors_in_place():
    text = format_call("calculator", {"expression": "1"}) + "<tool_call>oops</tool_call>" + format_call("python", {"code": ""})
    items = parse_tool_calls(text).items
    assert [getattr(i, "name", "error") for i in items] == ["calculator", "error", "python"]


# ---- the calculator ------------------------------------------------------------------------------
@pytest.mark.parametrize("expr, value", [
    ("123 * 456", 56088),          # 123·456 = 56,088
    ("2 ** 10 - 24", 1000),        # 1024 − 24
    ("-(7 - 10) * 3", 9),          # −(−3)·3
    ("17 // 5 + 17 % 5", 5),       # 3 + 2
    ("7 / 2", 3.5),
    ("2 ** -1", 0.5),
])
def test_calculator_values(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr, says", [
    ("__import__('os').system('true')", "unsupported element"),
    ("open('/etc/passwd')", "unsupported element"),
    ("x + 1", "unsupported element"),
    ("(1).__class__", "unsupported element"),
    ("[1, 2]", "unsupported element"),
    ("True + 1", "unsupported element"),       # bools are not numbers here
    ("'a' * 3", "unsupported element"),
    ("9 ** 9 ** 9", "exponent"),               # 9^387420489: refused before it is computed
    ("10 ** 64 * 10 ** 64", "larger than 10^100"),
    ("1 / 0", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("1e999", "not finite"),                  # the literal parses as inf
    ("1e99 * 1e99", "larger than 10^100"),
    ("1 +", "not an arithmetic expression"),
    ("(" * 5_000 + "1" + ")" * 5_000, "longer than"),
    ("-" * 150 + "1", None),                   # 150 unary minuses: fine (even count → 1)
])
def test_calculator_refuses_everything_else_with_a_reason(expr, says):
    if says is None:
        assert calculate(expr) == 1
        return
    with pytest.raises(CalculatorError, match=re.escape(says)):
        calculate(expr)


def test_calculator_tool_answers_bad_arguments_with_errors():
    got = Calculator().run([{"expression": "6 * 7"}, {"expr": "1"}, {"expression": 5}, {"expression": "10 / 2"}])
    assert got == [ToolResult("42"), ToolResult('error: calculator takes exactly {"expression": "<arithmetic>"}', True),
                   ToolResult('error: calculator takes exactly {"expression": "<arithmetic>"}', True),
                   ToolResult("5")]   # 10 / 2 = 5.0, shown as the integer


# ---- the executor --------------------------------------------------------------------------------
class _Exploding:
    name, description = "boom", "raises"

    def run(self, calls):
        raise RuntimeError("a bug in the tool")


class _Flood:
    name, description = "flood", "returns 10 MB"

    def run(self, calls):
        return [ToolResult("y" * 10_000_000) for _ in calls]


class _Short:
    name, description = "short", "returns one result too few"

    def run(self, calls):
        return [ToolResult("ok")] * (len(calls) - 1)


def test_a_tool_that_miscounts_its_results_is_an_error_for_every_call():
    text = format_call("short", {}) + format_call("short", {})
    results = run_calls(parse_tool_calls(text), {"short": _Short()})
    assert [r.error for r in results] == [True, True] and "RuntimeError" in results[0].content


def test_run_calls_answers_unknown_tools_buggy_tools_and_floods():
    text = (format_call("calculator", {"expression": "2 + 3"}) + format_call("nope", {}) + format_call("boom", {})
            + format_call("flood", {}) + "<tool_call>{</tool_call>")
    results = run_calls(parse_tool_calls(text, max_calls=8),
                        {"calculator": Calculator(), "boom": _Exploding(), "flood": _Flood()}, max_chars=100)
    assert results[0] == ToolResult("5")
    assert results[1].error and "unknown tool 'nope'" in results[1].content and "calculator" in results[1].content
    assert results[2].error and "RuntimeError" in results[2].content
    assert results[3].error and len(results[3].content) < 200 and "truncated: 10000000 characters" in results[3].content
    assert results[4].error and "not valid JSON" in results[4].content


# ---- ToolEnv and the registry --------------------------------------------------------------------
def test_tool_env_steps_calls_errors_and_the_answer():
    env = ToolEnv({"calculator": Calculator()}, score=lambda p, text: float(text.strip() == p.answer))
    messages = env.reset(Problem("What is 123 * 456?", answer="56088"))
    assert [m.role for m in messages] == ["system", "user"] and "<tool_call>" in messages[0].content
    r = env.step(format_call("calculator", {"expression": "123 * 456"}))
    assert (r.new_messages, r.done, r.reward, r.tool_calls, r.tool_errors) == ([Message("tool", "56088")], False, None, 1, 0)
    r = env.step("<tool_call>{\"name\": \"calculator\"</tool_call>" + format_call("calc", {}))
    assert not r.done and r.tool_calls == 0 and r.tool_errors == 2 and len(r.new_messages) == 2
    assert all(m.role == "tool" and m.content.startswith("error:") for m in r.new_messages)
    r = env.step("56088")
    assert r.done and r.reward == 1.0 and r.new_messages == []


def test_registry_builds_factories_and_names_bad_parameters():
    factory = build_environment("tools", tools=["calculator"])
    a, b = factory(), factory()
    assert a is not b  # one environment per episode
    factory.close()
    with pytest.raises(EnvironmentConfigError, match="unknown environment 'chess'"):
        build_environment("chess")
    with pytest.raises(EnvironmentConfigError, match="unknown parameter 'tool'"):
        build_environment("tools", tool=["calculator"])
    with pytest.raises(EnvironmentConfigError, match="unknown tool 'shell'"):
        build_environment("tools", tools=["shell"])


def test_the_system_prompt_shows_a_call_the_parser_accepts():
    env = ToolEnv({"calculator": Calculator()})
    system = env.reset(Problem("1 + 1?"))[0].content
    example = system[system.index("<tool_call>"): system.index("</tool_call>") + len("</tool_call>")]
    assert parse_tool_calls(example).items == [ToolCall("calculator", {"expression": "2 + 2"})]
    assert json.loads(example[len("<tool_call>"): -len("</tool_call>")])["name"] == "calculator"
