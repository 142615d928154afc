"""HumanEval: the data from the wheel, program assembly, the sandbox verdict, pass@k rows, the canonical sanity path."""

from __future__ import annotations

import pytest

from posttrain.sandbox import open_sandbox
from posttrain.tasks.humaneval import (
    CODEX_STOPS,
    evaluate_canonical,
    evaluate_humaneval,
    judge,
    load_humaneval,
    program_of,
    records_of,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pool():
    try:
        with open_sandbox() as p:
            yield p
    except Exception as e:  # bubblewrap missing: say so rather than fail every test
        pytest.skip(f"no sandbox: {e}")


def test_loads_all_164_problems_from_the_wheel():
    problems = load_humaneval()
    assert len(problems) == 164
    assert problems[0].task_id == "HumanEval/0" and problems[0].entry_point == "has_close_elements"
    assert problems[163].task_id == "HumanEval/163"
    assert [p.task_id for p in load_humaneval(limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_canonical_solutions_score_100_percent(pool):
    rows = {r.metric: r for r in evaluate_canonical(pool=pool)}
    # 164 of 164 pass → pass@1 = 1.0, stderr across problems = 0
    assert rows["pass@1"].value == 1.0 and rows["pass@1"].n == 164 and rows["pass@1"].stderr == 0.0
    assert rows["sandbox_errors"].value == 0


def test_wrong_bodies_fail_and_pass_at_1_counts_them(pool):
    problems = load_humaneval(limit=4)
    completions = [[problems[0].canonical_solution], ["    return None\n"], [problems[2].canonical_solution],
                   ["    raise SystemExit(0)\n"]]  # exits 0 before `check` runs: the exit code is no evidence
    verdicts = judge(problems, completions, "completion", pool=pool)
    assert [v[0].reward for v in verdicts] == [1.0, 0.0, 1.0, 0.0]
    rows = {r.metric: r for r in records_of(verdicts, (1,), stage="s", checkpoint="c", eval_name="humaneval")}
    # 2 of 4 pass → 0.5; per-problem values 1,0,1,0: s = √(4·0.25/3) = 0.5774, stderr = s/√4 = 0.2887
    assert rows["pass@1"].value == 0.5
    assert rows["pass@1"].stderr == pytest.approx(0.2887, abs=1e-4)


def test_chat_reply_code_block_replaces_the_stub(pool):
    p = load_humaneval(limit=1)[0]
    full = "def has_close_elements(numbers, threshold):\n" + p.canonical_solution
    reply = f"Here is the function:\n```python\n{full}```\nIt compares every pair."
    body_only = f"```python\n{p.canonical_solution}```"      # an indented body completes the prompt's stub
    unterminated = f"```python\n{full}"                        # cut by the token budget inside the fence
    prose = "I would loop over all pairs."                     # no code: the text itself is not Python
    verdicts = judge([p] * 4, [[reply], [body_only], [unterminated], [prose]], "chat", pool=pool)
    assert [v[0].reward for v in verdicts] == [1.0, 1.0, 1.0, 0.0]


def test_completion_format_cuts_at_the_codex_stop_sequences():
    p = load_humaneval(limit=1)[0]
    program = program_of(p, "    return False\n\ndef extra():\n    pass\n", "completion")
    assert "def extra" not in program and program.startswith(p.prompt + "    return False\n")
    assert "\ndef" in CODEX_STOPS and program.rstrip().endswith(p.test.rstrip())


def test_evaluate_humaneval_on_a_tiny_model(policy_dir, pool):
    """The signature the `humaneval` task calls, end to end on a random tiny model: it writes no working
    Python, so every pass@k is 0; the rows are the ones promised."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    opened = []

    def phase():
        from contextlib import nullcontext
        opened.append(1)
        return nullcontext()

    rows = evaluate_humaneval(model, tok, stage="sft", checkpoint="ck", ks=(1, 2), samples=2, temperature=1.0,
                              max_new_tokens=8, batch_size=4, phase=phase, limit=3, pool=pool)
    got = {(r.eval, r.metric): r for r in rows}
    assert set(got) == {("humaneval", "pass@1"), ("humaneval", "sandbox_errors"), ("humaneval@T1", "pass@1"),
                        ("humaneval@T1", "pass@2"), ("humaneval@T1", "sandbox_errors")}
    assert all(r.n == 3 and r.stage == "sft" and r.checkpoint == "ck" for r in rows)
    assert got[("humaneval", "pass@1")].value == 0.0 and got[("humaneval@T1", "pass@2")].value == 0.0
    assert len(opened) == 1  # 3 greedy prompts in one batch of 4 → one timed phase
    with pytest.raises(ValueError, match="every k must be in"):
        evaluate_humaneval(model, tok, stage="s", checkpoint="c", ks=(4,), samples=2, temperature=1.0,
                           max_new_tokens=2, batch_size=4, limit=1, pool=pool)
