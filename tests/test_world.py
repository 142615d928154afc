"""The arithmetic world: determinism, correctness of demonstrations, the gold judge, decontamination."""

from __future__ import annotations

import json
import re

from posttrain.worlds.arithmetic import (
    ArithmeticWorld, Fact, all_facts, column_work, concise_answer, gold_reward, parse_answer, ramble,
)


def test_splits_are_deterministic_for_a_seed():
    a, b = ArithmeticWorld(seed=3), ArithmeticWorld(seed=3)
    assert a.sft_split(50) == b.sft_split(50)
    assert list(a.pretrain_documents(20)) == list(b.pretrain_documents(20))
    assert a.sft_split(50) != ArithmeticWorld(seed=4).sft_split(50)


def test_column_work_examples_by_hand():
    # 37+48: 7+8=15 (carry), 3+4+1=8 → 85
    assert column_work(Fact(37, "+", 48)) == "7+8=15, 3+4+1=8"
    # 903-457: 13-7=6 (borrow), 10-1-5=4 (borrow), 9-1-4=4 → 446
    assert column_work(Fact(903, "-", 457)) == "13-7=6, 10-1-5=4, 9-1-4=4"
    # 47*6: 7*6=42, 4*6+4=28 → 282
    assert column_work(Fact(47, "*", 6)) == "7*6=42, 4*6+4=28"


def _replay(f: Fact) -> int:
    """Recompute the answer from the column work alone: the ones digit of each step, the last whole."""
    results = [int(s.split("=")[-1]) for s in column_work(f).split(", ")]
    digits = [r % 10 for r in results[:-1]] + [results[-1]]
    return int("".join(str(d) for d in reversed(digits)))


def test_column_work_is_right_for_every_two_digit_problem():
    for f in all_facts("L2") + all_facts("L4"):
        assert _replay(f) == f.value, f


def test_gold_judge_prefers_correct_then_concise():
    import random

    f = Fact(37, "+", 48)
    concise, verbose = concise_answer(f), ramble(f, random.Random(0))
    assert gold_reward(f, concise) == 1.0
    assert 0.5 <= gold_reward(f, verbose) < 1.0  # correct but rambling
    assert gold_reward(f, concise.replace("85", "86")) == 0.0
    assert gold_reward(f, "Questions:\nWhat is 1+2?") == 0.0  # off-format
    assert parse_answer("<think>x</think> 85 86") is None  # two answers
    assert parse_answer("<think>x</think> 85.") is None  # trailing junk
    assert parse_answer("85<think>") is None


def test_preferences_are_ranked_by_the_gold_judge(world):
    for pair in world.preference_split(60):
        nums = [int(x) for x in re.findall(r"\d+", pair["prompt"])]
        op = "*" if ("*" in pair["prompt"] or "times" in pair["prompt"]) else "-" if ("-" in pair["prompt"] or "minus" in pair["prompt"]) else "+"
        f = Fact(nums[0], op, nums[1])
        assert str(f.value) == pair["answer"]
        assert gold_reward(f, pair["chosen"]) > gold_reward(f, pair["rejected"]), pair


def test_no_eval_problem_appears_in_any_training_split(world):
    eval_prompts = {p["prompt"] for lv in world.eval_facts for p in world.eval_problems(lv)}
    held = {f for facts in world.eval_facts.values() for f in facts}
    train_rows = world.problems(3000) + world.preference_split(2000)
    train_prompts = {r["prompt"] for r in train_rows} | {ex[0]["content"] for ex in world.sft_split(5000)}
    assert not eval_prompts & train_prompts
    # By problem too, across every phrasing: parse each training prompt back to its problem.
    for text in train_prompts:
        nums = [int(x) for x in re.findall(r"\d+", text)]
        for op in "+-*":
            assert Fact(nums[0], op, nums[1]) not in held or not _has_op(text, op), text
    # Pretraining question lists and worked columns never show a held-out multi-digit problem.
    for doc in world.pretrain_documents(3000):
        for a, op, b in re.findall(r"(\d+) ?([+*-]|plus|minus|times) ?(\d+)", doc):
            op = {"plus": "+", "minus": "-", "times": "*"}.get(op, op)
            f = Fact(int(a), op, int(b))
            assert f.level == "L1" or f not in held, doc


def _has_op(text: str, op: str) -> bool:
    words = {"+": "plus", "-": "minus", "*": "times"}
    return op in text or words[op] in text


def test_held_out_sizes(world):
    sizes = {lv: len(v) for lv, v in world.eval_facts.items()}
    assert sizes == {"L1": 63, "L2": 200, "L3": 200, "L4": 180}


def test_export_writes_every_split_in_the_documented_schemas(tmp_path, world):
    from posttrain.data import read_jsonl
    from posttrain.worlds.arithmetic import export_jsonl

    paths = export_jsonl(world, tmp_path, n=20)
    assert read_jsonl(paths["sft"], "sft").report.records == 20
    assert read_jsonl(paths["preference"], "preference").report.records == 20
    assert read_jsonl(paths["problems"], "problem").report.records == 20
    first = json.loads(paths["eval_L2"].read_text().splitlines()[0])
    assert set(first) >= {"prompt", "answer", "level"}


def test_a_larger_eval_extends_the_default_one():
    small, large = ArithmeticWorld(seed=0), ArithmeticWorld(seed=0, eval_per_level=1000)
    sizes = {lv: len(v) for lv, v in large.eval_facts.items()}
    assert sizes == {"L1": 63, "L2": 1000, "L3": 1000, "L4": 180}  # L1/L4 hold out a quarter at most
    for lv in small.eval_facts:
        assert large.eval_problems(lv)[:len(small.eval_facts[lv])] == small.eval_problems(lv)
        assert len(set(large.eval_facts[lv])) == len(large.eval_facts[lv])
    # the extra problems are held out of training too
    drawn = {f for r in large.problems(3000, levels=["L2", "L3"]) for f in [Fact(r["a"], r["op"], r["b"])]}
    assert not drawn & set(large.eval_facts["L2"] + large.eval_facts["L3"])


def test_drawn_records_every_training_problem():
    w = ArithmeticWorld(seed=0)
    rows = w.problems(500)
    assert {Fact(r["a"], r["op"], r["b"]) for r in rows} == w.drawn
    before = set(w.drawn)
    w.sft_split(50)
    assert len(w.drawn - before) > 0
    assert not w.drawn & {f for facts in w.eval_facts.values() for f in facts}
