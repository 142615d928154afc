"""The rejection_sampling stage (selection by hand, the SFT hand-off) and pass@k evals."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.data import Problem, read_jsonl
from posttrain.tasks import EvalRequest, evaluate as evals_mod
from posttrain.tasks.arithmetic import ArithmeticTask
from posttrain.runtime.config import (
    Recipe,
    RejectionSamplingStage,
    SFTStage,
)
from posttrain.runtime.context import RunContext
from posttrain.stages.rejection_sampling import (
    best_and_worst,
    output_path,
    pairs_path,
    produced_paths,
    run_rejection_sampling,
    select,
)
from posttrain.stages.sft import run_sft
from posttrain.telemetry import Telemetry
from conftest import ListSink, make_reward_model, world_tasks

PROBLEM = Problem(prompt="What is 2+3?", answer="5", level="L1")


def test_select_best_prefers_reward_then_shorter():
    texts = ["The result should be 5", "5", " 5 ", "4", "55555", "  "]
    rewards = [0.8, 1.0, 1.0, 0.0, None, 0.0]
    finish = ["stop", "stop", "stop", "stop", "stop", "stop"]
    kept, counts = select(PROBLEM, texts, rewards, finish, keep="best", min_reward=0.5)
    assert kept == [("5", 1.0)]  # two 1.0s, " 5 " is a whitespace duplicate of "5"
    assert counts == {"truncated": 0, "empty": 1, "unjudged": 1, "below_min": 1, "duplicates": 1}


def test_select_all_correct_drops_truncated_and_duplicates():
    texts = ["<think>2+3=5</think> 5", "<think>2+3=5</think>  5", "5", "<think>2+3=5</think> 5 5 5"]
    rewards = [1.0, 1.0, 1.0, 1.0]
    finish = ["stop", "stop", "stop", "length"]
    kept, counts = select(PROBLEM, texts, rewards, finish, keep="all_correct", min_reward=0.5)
    # the second is the first with a doubled space; the last was cut by the budget
    assert kept == [("<think>2+3=5</think> 5", 1.0), ("5", 1.0)]
    assert counts["truncated"] == 1 and counts["duplicates"] == 1
    # a tie on reward and length goes to the first sampled
    kept, _ = select(PROBLEM, ["6", "5"], [1.0, 1.0], ["stop", "stop"], keep="best", min_reward=0.5)
    assert kept == [("6", 1.0)]


def test_rejection_sampling_writes_sft_data_an_sft_stage_reads(tmp_path, policy_dir, tokenizer, world):
    # An untrained policy rarely answers right, so keep everything judged that ended its turn (min_reward 0):
    # the test is about the hand-off, not the policy.
    rs = RejectionSamplingStage(samples=4, batch_prompts=8, max_new_tokens=16, min_reward=0.0, keep="all_correct",
                                data=[{"world": "arithmetic", "n": 16}])
    sft = SFTStage(steps=2, batch_size=1, heldout=0, max_len=96, truncation="drop", log_every=1,
                   data=[{"path": str(tmp_path / "data" / "rejection_sampling.jsonl")}])
    recipe = Recipe(stages=[rs, sft], threads=1)
    sink = ListSink()
    ctx = RunContext(run_dir=tmp_path, recipe=recipe, device=torch.device("cpu"), tokenizer=tokenizer, tasks=world_tasks(world),
                     telemetry=Telemetry.disabled(), sink=sink, start=policy_dir)
    result = run_rejection_sampling(rs, ctx)
    out = output_path(rs, tmp_path)
    assert out == tmp_path / "data" / "rejection_sampling.jsonl"
    assert produced_paths(recipe, tmp_path) == {out.resolve(): 0}
    assert (result.checkpoint / "model.safetensors").is_file()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    summary = [r for r in sink.records if "rs/rows" in r][-1]
    assert len(rows) == summary["rs/rows"] > 0
    pairs = [(json.dumps(r["messages"][:-1]), " ".join(r["messages"][-1]["content"].split())) for r in rows]
    assert len(set(pairs)) == len(pairs)  # deduplicated
    assert all(r["messages"][-1]["role"] == "assistant" and r["answer"] is not None for r in rows)
    records = read_jsonl(out, "sft").records  # our schema
    assert records[0].meta["level"] in ("L1", "L2", "L3", "L4")
    # the hand-off: an SFT stage names the file as a `path` source and trains on it
    ctx.start = result.checkpoint
    done = run_sft(sft, ctx)
    assert (done.checkpoint / "model.safetensors").is_file()
    assert [r["step"] for r in sink.records if r["stage"] == "sft"] == [1, 2]


def test_best_and_worst_pair_by_hand():
    texts = ["5", "The answer is 5", "4", "44444444", "", "6"]
    rewards = [1.0, 0.75, 0.0, 0.0, 0.0, None]
    finish = ["stop", "stop", "stop", "length", "stop", "stop"]
    # chosen "5" (1.0); rejected "4" (0.0): "44444444" was cut by the budget, "" is empty, "6" unjudged
    assert best_and_worst(texts, rewards, finish, min_reward=0.9, margin=0.25) == (("5", 1.0), ("4", 0.0))
    # a tie at the bottom goes to the longer: "4" vs "40" both 0.0 → "40"
    assert best_and_worst(["5", "4", "40"], [1.0, 0.0, 0.0], ["stop"] * 3, min_reward=0.9, margin=0.0)[1] == ("40", 0.0)
    # 1.0 − 0.75 = 0.25: a pair above margin 0.2, none at margin 0.25 (the margin must be exceeded)
    assert best_and_worst(texts[:2], rewards[:2], finish[:2], min_reward=0.9, margin=0.2) == (("5", 1.0), ("The answer is 5", 0.75))
    assert best_and_worst(texts[:2], rewards[:2], finish[:2], min_reward=0.9, margin=0.25) is None
    # no chosen: the best (0.75) is under min_reward 0.9
    assert best_and_worst(texts[1:4], rewards[1:4], finish[1:4], min_reward=0.9, margin=0.0) is None
    assert best_and_worst(["5"], [1.0], ["stop"], min_reward=0.9, margin=0.0) is None  # one sample: no pair


def test_pairs_are_preference_data_and_another_draw_is_other_prompts(tmp_path, policy_dir, tokenizer, world):
    # an untrained policy ends a turn rarely: many samples, and a length reward (always judged, differs
    # between replies) so that prompts with two finished samples give pairs
    def run(draw: int):
        cfg = RejectionSamplingStage(name=f"d{draw}", samples=16, batch_prompts=16, max_new_tokens=48, min_reward=-1.0,
                                     rewards=[{"name": "length", "params": {"max_len": 128, "count": "chars"}}],
                                     pairs=True, draw=draw, data=[{"task": "arithmetic", "n": 16}])
        sink = ListSink()
        ctx = RunContext(run_dir=tmp_path, recipe=Recipe(stages=[cfg], threads=1), device=torch.device("cpu"),
                         tokenizer=tokenizer, tasks=world_tasks(world), telemetry=Telemetry.disabled(), sink=sink,
                         start=policy_dir)
        run_rejection_sampling(cfg, ctx)
        assert produced_paths(ctx.recipe, tmp_path) == {output_path(cfg, tmp_path).resolve(): 0,
                                                         pairs_path(cfg, tmp_path).resolve(): 0}
        assert pairs_path(cfg, tmp_path) == tmp_path / "data" / f"d{draw}.pairs.jsonl"
        pairs = read_jsonl(pairs_path(cfg, tmp_path), "preference").records
        prompts = {json.dumps(r.messages[:-1], default=vars) for r in read_jsonl(output_path(cfg, tmp_path), "sft").records}
        return pairs, prompts, sink.records[-1]

    pairs, prompts, summary = run(0)
    assert len(pairs) == summary["rs/pairs"] > 0
    assert summary["rs/pairs"] + summary["rs/prompts_without_pair"] == 16
    for p in pairs:  # the length reward is −len/128: the chosen is the shorter reply
        assert p.meta["chosen_reward"] > p.meta["rejected_reward"] and len(p.chosen) < len(p.rejected)
    again, _, _ = run(0)
    assert [(p.prompt, p.chosen, p.rejected) for p in again] == [(p.prompt, p.chosen, p.rejected) for p in pairs]
    _, other, _ = run(1)
    assert prompts and other and not prompts & other  # draw 1: other prompts (16 of the world's many)

# ---- pass@k evals ------------------------------------------------------------------------------
class _FakeRollout:
    def __init__(self, texts: list[str]):
        self.texts = texts
        self.finish_reason = ["stop"] * len(texts)


class _ScriptedEngine:
    """Answers problem j correctly in the first c_j of its n samples (prompts come in eval order)."""

    def __init__(self, answers: list[int], correct: list[int]):
        self.answers, self.correct, self.seen = answers, correct, 0

    def generate(self, prompts, params):
        texts = []
        for _ in prompts:
            j = self.seen
            texts += [str(self.answers[j]) if s < self.correct[j] else str(self.answers[j] + 1) for s in range(params.n)]
            self.seen += 1
        return _FakeRollout(texts)


def test_pass_at_k_evals_by_hand(world, tokenizer, monkeypatch):
    problems = world.eval_problems("L2")[:3]
    engine = _ScriptedEngine([int(p["answer"]) for p in problems], correct=[0, 1, 4])
    monkeypatch.setattr(evals_mod, "make_engine", lambda *a, **k: engine)
    task = ArithmeticTask(world=world)
    req = EvalRequest(per_level=3, levels=("L2",), batch_size=8, greedy=False, probe=False, k=(1, 2), samples=4)  # 8 rows / 4 samples = 2 prompts per call
    recs = task.evaluate(torch.nn.Linear(1, 1), tokenizer, req, stage="grpo", checkpoint="c")
    by = {(r.level, r.metric): r for r in recs}
    # c = (0, 1, 4) of n = 4. pass@1 = mean(c/n) = (0 + 0.25 + 1)/3 = 0.41667
    assert by[("L2", "pass@1")].value == pytest.approx(0.416667, abs=1e-5)
    # pass@2: 1 − C(4−c, 2)/C(4, 2): c=0 → 0; c=1 → 1 − 3/6 = 0.5; c=4 → 1  → mean 0.5
    assert by[("L2", "pass@2")].value == pytest.approx(0.5)
    assert by[(None, "pass@2")].value == pytest.approx(0.5)  # the pooled row (one level here)
    # stderr of (0, 0.5, 1): s = 0.5, / √3 = 0.288675
    assert by[("L2", "pass@2")].stderr == pytest.approx(0.288675, abs=1e-5)
    assert {r.eval for r in recs} == {"arithmetic@T1"} and all(r.n == 3 for r in recs)
    with pytest.raises(ValueError, match="every k"):
        task.evaluate(torch.nn.Linear(1, 1), tokenizer, EvalRequest(levels=("L2",), per_level=3, greedy=False, probe=False,
                                                                    k=(8,), samples=4), stage="s", checkpoint="c")


# ---- scoring by a reward model -----------------------------------------------------------------


def _kept(tmp_path, name, policy_dir, tokenizer, world, **stage):
    # an untrained policy ends its turn rarely (truncated replies are never kept): many short samples
    cfg = RejectionSamplingStage(name=name, samples=8, batch_prompts=16, max_new_tokens=32, min_reward=-1e9,
                                 data=[{"world": "arithmetic", "n": 16}], **stage)
    ctx = RunContext(run_dir=tmp_path, recipe=Recipe(stages=[cfg], threads=1), device=torch.device("cpu"),
                     tokenizer=tokenizer, tasks=world_tasks(world), telemetry=Telemetry.disabled(), sink=ListSink(), start=policy_dir)
    run_rejection_sampling(cfg, ctx)
    rows = [json.loads(line) for line in output_path(cfg, tmp_path).read_text().splitlines()]
    return {(json.dumps(r["messages"][:-1]), r["messages"][-1]["content"]): r["reward"] for r in rows}


def test_rejection_sampling_scores_by_a_reward_model_alone_or_added_to_verifiers(tmp_path, policy_dir, tokenizer, world):
    rm_dir = make_reward_model(tmp_path / "rm", policy_dir, mean=0.5, std=2.0)
    gold = _kept(tmp_path, "gold", policy_dir, tokenizer, world, keep="all_correct")
    rm = _kept(tmp_path, "rm", policy_dir, tokenizer, world, keep="all_correct", rewards=[], reward_model=str(rm_dir))
    both = _kept(tmp_path, "both", policy_dir, tokenizer, world, keep="all_correct", reward_model=str(rm_dir),
                 reward_model_weight=0.5)
    # the same seeded samples in all three runs: every kept reply scored three ways
    assert set(gold) == set(rm) == set(both)
    assert len(rm) > len({p for p, _ in rm}) >= 4                   # some prompt kept several: "best" has a choice
    assert len(set(rm.values())) == len(rm)                          # a real score, not a constant
    assert all(both[k] == pytest.approx(gold[k] + 0.5 * rm[k], abs=1e-5) for k in both)
    # the reward model's score is normalized: (raw − 0.5) / 2, so "best" is still its argmax per prompt
    best = _kept(tmp_path, "best", policy_dir, tokenizer, world, keep="best", rewards=[], reward_model=str(rm_dir))
    for (prompt, reply), r in best.items():
        assert r == max(v for (p, _), v in rm.items() if p == prompt)


def test_rejection_sampling_needs_something_to_score_with(tmp_path, policy_dir, tokenizer, world):
    with pytest.raises(ValueError, match="nothing would score the samples"):
        RejectionSamplingStage(rewards=[], data=[{"task": "arithmetic", "n": 8}])
    with pytest.raises(ValueError, match="neither a finished reward_model stage"):
        _kept(tmp_path, "x", policy_dir, tokenizer, world, reward_model=str(tmp_path / "nowhere"))
