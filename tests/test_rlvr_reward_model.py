"""A trained reward model as one of GRPO's rewards, beside rule verifiers: the recipe's schema, its
score summed by `rewards.combine` and logged as `reward/reward_model`, a GRPO stage started from the
reward model's folder (the pipeline's hand-off after a reward_model stage), and the errors for a
missing reward model or one of another vocabulary."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from posttrain.models import load_model, train_tokenizer
from posttrain.rewards import WeightedVerifier, build_verifier
from posttrain.rollout import SamplingParams, make_engine
from posttrain.runtime.config import GRPOStage, RewardSpec
from posttrain.stages._learned_reward import RewardModelScorer, RewardModelVerifier
from posttrain.stages._rlvr import build_rewards, encode_problems, load_problems, load_reward_models, score_rollout, score_texts
from posttrain.stages.grpo import run_grpo
from conftest import make_ctx, make_reward_model

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTH = {"name": "length", "params": {"max_len": 64, "count": "chars"}, "weight": 0.5}


def test_reward_spec_names_its_reward_model():
    spec = RewardSpec(name="reward_model", stage="rm", weight=0.5)
    assert (spec.stage, spec.weight) == ("rm", 0.5)
    with pytest.raises(ValueError, match="needs `stage`"):
        RewardSpec(name="reward_model")
    with pytest.raises(ValueError, match="takes no params"):
        RewardSpec(name="reward_model", stage="rm", params={"x": 1})
    with pytest.raises(ValueError, match="`stage` is for `reward_model` only"):
        RewardSpec(name="math", stage="rm")
    cfg = GRPOStage(data=[{"task": "arithmetic", "n": 8}], rewards=[{"name": "reward_model", "stage": "rm"}, LENGTH])
    assert [r.name for r in cfg.rewards] == ["reward_model", "length"]


def test_reward_model_summed_with_a_rule_reward(tmp_path, policy_dir, tokenizer, world):
    rm_dir = make_reward_model(tmp_path / "rm", policy_dir, mean=0.5, std=2.0)
    cfg = GRPOStage(data=[{"world": "arithmetic", "n": 4}],
                    rewards=[{"name": "reward_model", "stage": str(rm_dir), "weight": 2.0}, LENGTH])
    ctx, _ = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    verifiers = build_rewards(cfg.rewards)
    assert isinstance(verifiers[0].verifier, RewardModelVerifier) and verifiers[0].verifier.scorer is None
    load_reward_models(verifiers, ctx, "grpo")
    problems = load_problems(ctx, cfg.data, levels=None)
    engine = make_engine("native", load_model(policy_dir), tokenizer)
    ro = engine.generate(encode_problems(problems, tokenizer, 64), SamplingParams(n=3, max_new_tokens=12, seed=0))
    got = score_rollout(verifiers, ro, problems)
    # the reward model's column is its scorer's normalized last-token score, (raw − 0.5) / 2, row by row
    direct = RewardModelScorer(rm_dir, torch.device("cpu"))(ro).tolist()
    assert got.per_verifier["reward_model"] == pytest.approx(direct, abs=1e-6)
    assert len(set(direct)) > 1  # a real score that differs between replies
    # the length penalty alone, as the registry builds it
    length = build_verifier("length", max_len=64, count="chars")(list(ro.texts), lengths=ro.completion_lengths.tolist())
    assert got.per_verifier["length"] == pytest.approx(length)
    # total = 2 · rm + 0.5 · length, per row
    assert got.total == pytest.approx([2 * r + 0.5 * l for r, l in zip(direct, length)], abs=1e-6)
    m = got.metrics()
    assert m["reward/reward_model"] == pytest.approx(sum(direct) / len(direct), abs=1e-6)
    # texts alone (an episode's final text) carry no token ids: a configuration error, not a silent 0
    with pytest.raises(ValueError, match="scores token ids"):
        score_texts(verifiers, list(ro.texts), [problems[i] for i in ro.prompt_index.tolist()],
                    ro.completion_lengths.tolist())


def test_grpo_from_the_reward_model_folder_trains_the_policy_on_both_signals(tmp_path, policy_dir, tokenizer, world):
    # After a reward_model stage the pipeline hands the next stage the reward model's folder: GRPO must
    # train the policy that reward model was built for (reward_norm.json), scored by it and a rule.
    rm_dir = make_reward_model(tmp_path / "rm", policy_dir)
    cfg = GRPOStage(steps=2, batch_size=8, group_size=4, max_new_tokens=8, log_every=1, save_every=2,
                    data=[{"world": "arithmetic", "n": 16}],
                    rewards=[{"name": "reward_model", "stage": str(rm_dir)}, LENGTH],
                    optim={"lr": 1e-3, "warmup_steps": 0})
    ctx, sink = make_ctx(tmp_path / "run", rm_dir, tokenizer, world, cfg)
    result = run_grpo(cfg, ctx)
    recs = [r for r in sink.records if r["stage"] == "grpo"]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:  # both signals logged, and the total is their weighted mean over the judged rows
        assert {"reward/reward_model", "reward/length", "reward/total"} <= set(r)
        assert r["reward/total"] == pytest.approx(r["reward/reward_model"] + 0.5 * r["reward/length"], abs=1e-5)
    # the trained checkpoint is the causal LM (the policy), not the reward model's scalar head
    cfg_json = json.loads((result.checkpoint / "config.json").read_text())
    assert any(a.endswith("ForCausalLM") for a in cfg_json["architectures"]), cfg_json["architectures"]


def test_reward_model_missing_or_of_another_vocabulary(tmp_path, policy_dir, tokenizer, world):
    cfg = GRPOStage(data=[{"world": "arithmetic", "n": 4}], rewards=[{"name": "reward_model", "stage": "rm"}])
    ctx, _ = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    with pytest.raises(ValueError, match="grpo: reward_model 'rm' is neither a finished reward_model stage"):
        load_reward_models(build_rewards(cfg.rewards), ctx, "grpo")
    # a reward model whose tokenizer is another one: its ids mean other tokens
    rm_dir = make_reward_model(tmp_path / "rm_other", policy_dir)
    train_tokenizer([f"{a} * {a} = {a * a}" for a in range(300)], vocab_size=300).save_pretrained(rm_dir)
    with pytest.raises(ValueError, match="trained with another vocabulary"):
        load_reward_models(build_rewards([RewardSpec(name="reward_model", stage=str(rm_dir))]), ctx, "grpo")
    # no tokenizer beside it and an embedding table smaller than the run's vocabulary
    small = tmp_path / "rm_small"
    shutil.copytree(make_reward_model(tmp_path / "rm_ok", policy_dir), small)
    conf = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**conf, "vocab_size": 100}))
    with pytest.raises(ValueError, match="an embedding table of 100 ids"):
        load_reward_models(build_rewards([RewardSpec(name="reward_model", stage=str(small))]), ctx, "grpo")
    # the same folder, untouched, loads (no tokenizer saved: the embedding table covers every id)
    ok = build_rewards([RewardSpec(name="reward_model", stage=str(tmp_path / "rm_ok"))])
    load_reward_models(ok, ctx, "grpo")
    assert isinstance(ok[0], WeightedVerifier) and ok[0].verifier.scorer is not None
