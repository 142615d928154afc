"""Format verifier and the answer-span grammar shared with the accuracy checkers."""

from __future__ import annotations

import pytest

from posttrain.rewards import (
    ThinkMode,
    VerifierInputError,
    answer_span,
    extract_answer,
    final_answer,
    format_answer,
    format_reward,
)

# (completion, answer under REQUIRED, answer under OPTIONAL); None = format fails (reward 0).
CASES = [
    ("<think>12+7=19, 19*2=38</think> 38", "38", "38"),  # the R1 shape
    ("  <think>\n12+7=19\n</think>\n\n19\n", "19", "19"),  # surrounding whitespace is fine
    ("<think>x</think> \\boxed{38}", "38", "38"),  # boxed
    ("<think>x</think> So the answer is $\\boxed{38}$.", "38", "38"),  # prose before the box
    ("<think>x</think> $\\frac{3}{4}$", "\\frac{3}{4}", "\\frac{3}{4}"),  # one math segment
    ("<think>x</think> \\(x + 1\\)", "x + 1", "x + 1"),  # spaces allowed inside delimiters
    ("<think>x</think> -1,234.", "-1,234", "-1,234"),  # trailing period stripped
    ("<think>x</think> \\boxed{38} \\boxed{38}", "38", "38"),  # the same box twice is one answer
    ("38", None, "38"),  # no think block: only OPTIONAL accepts it
    ("\\boxed{\\frac{1}{2}}", None, "\\frac{1}{2}"),
    ("<think></think> 38", None, "38"),  # empty reasoning: a REQUIRED block must hold reasoning
    ("<think>x</think>", None, None),  # missing answer
    ("<think>x 38", None, None),  # reasoning never closed
    ("<think>x</think> 38 39", None, None),  # two answers
    ("<think>x</think> 38\n39", None, None),  # two answers on two lines
    ("<think>x</think> $38$ and $39$", None, None),  # two math segments
    ("<think>x</think> \\boxed{38} or \\boxed{39}", None, None),  # two different boxes
    ("<think>x</think> 38 because 19*2=38", None, None),  # trailing junk
    ("<think>x</think> \\boxed{38} because it is", None, None),  # trailing junk after the box
    ("<think>x</think> 38<|im_end|>", None, None),  # a special token left in
    ("<think>x</think> 38</answer>", None, None),  # a stray tag
    ("<think>x</think> 38 <think>y</think> 39", None, None),  # a second think block
    ("<think>a<think>b</think></think> 38", None, None),  # nested think
    ("<think>x</think> The answer is 38", None, None),  # prose with no declared answer
    ("<think>x</think> \\boxed{38", None, None),  # unbalanced box
    ("<think>x</think> \\boxed 38", None, None),  # box without braces
    ("prefix <think>x</think> 38", None, None),  # text before the think block
]


@pytest.mark.parametrize(("completion", "required", "optional"), CASES)
def test_format_answer_golden(completion, required, optional):
    assert format_answer(completion, think=ThinkMode.REQUIRED) == required
    assert format_answer(completion, think=ThinkMode.OPTIONAL) == optional


def test_format_reward_is_one_exactly_when_an_answer_was_parsed():
    completions = [c for c, _, _ in CASES]
    rewards = format_reward(completions, think=ThinkMode.REQUIRED)
    expected = [0.0 if required is None else 1.0 for _, required, _ in CASES]
    assert rewards == expected  # 8 well-formed R1 completions of 27
    assert sum(rewards) == 8.0
    optional = format_reward(completions, think="optional")
    assert sum(optional) == 11.0  # + "38", "\\boxed{\\frac12}", empty-reasoning "38"


def test_accuracy_checkers_grade_the_span_the_format_check_validated():
    # Wherever the format passes, final_answer (what math grades) returns the same answer.
    for completion, required, optional in CASES:
        if optional is not None:
            assert final_answer(completion) == optional, completion


def test_final_answer_accepts_a_think_opened_in_the_prompt():
    # Chat templates that put "<think>" in the prompt leave only "</think>" in the completion.
    assert final_answer("19*2=38</think> 38") == "38"
    assert format_answer("19*2=38</think> 38", think=ThinkMode.REQUIRED) is None  # format is stricter


def test_answer_span_and_extract_answer_pieces():
    assert answer_span("<think>r</think>  \\boxed{1}  ") == "\\boxed{1}"
    assert answer_span("1", think=ThinkMode.REQUIRED) is None
    assert extract_answer("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"  # escaped braces do not close the box
    assert extract_answer("\\boxed{\\frac{1}{\\boxed{2}}}") == "\\frac{1}{\\boxed{2}}"  # inner box is content
    assert extract_answer("\\[ \\boxed{7} \\]") == "7"  # closing display delimiter after the box
    assert extract_answer("$$x^2$$") == "x^2"
    assert extract_answer("x<3") == "x<3"  # an inequality is not a tag
    assert extract_answer("   ") is None


def test_bad_think_mode_is_a_clear_error():
    with pytest.raises(VerifierInputError, match="think mode 'sometimes' is not one of: required, optional"):
        format_reward(["38"], think="sometimes")
    with pytest.raises(VerifierInputError, match="completions must be a list of strings"):
        format_reward("38")
