"""Smoke tests of the reward_model, dpo and ppo stages on a tiny model, driven without the pipeline.

Each stage runs a few steps from a randomly initialised tiny-1m policy; every trainable parameter must
change and the metric the stage exists for must move the right way. Plus the invariant the issue asks
for: caching reference log-probs gives the same losses as recomputing them every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.models.heads import RewardNormalization, load_scalar_model
from posttrain.runtime.config import DPOStage, PPOStage, RewardModelStage
from posttrain.stages.dpo import run_dpo
from posttrain.stages.ppo import run_ppo
from posttrain.stages.reward_model import run_reward_model
from conftest import ListSink, make_ctx, make_reward_model

FAST = {"lr": 3e-3, "warmup_steps": 1, "min_lr_ratio": 1.0}


pytestmark = pytest.mark.usefixtures("one_thread")


def assert_all_changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> None:
    unchanged = [k for k in before if k in after and not k.startswith(skip) and torch.equal(before[k], after[k])]
    assert not unchanged, f"parameters that did not change: {unchanged}"


def by_step(sink: ListSink, stage: str) -> dict[int, dict]:
    return {r["step"]: r for r in sink.records if r["stage"] == stage}


# ---- reward model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reward_model_run(tmp_path_factory, policy_dir, tokenizer, world):
    run_dir = tmp_path_factory.mktemp("rm_run")
    # 16 pairs + 8 rankings, all in every batch: the loss trend is the optimizer's, not batch noise.
    cfg = RewardModelStage(steps=6, batch_size=24, heldout=32, norm_samples=16, samples_per_prompt=4, max_new_tokens=12,
                           data=[{"world": "arithmetic", "n": 16}], rankings=[{"world": "arithmetic", "n": 8}],
                           log_every=1, optim=FAST)
    ctx, sink = make_ctx(run_dir, policy_dir, tokenizer, world, cfg)
    result = run_reward_model(cfg, ctx)
    return run_dir, result, sink


def test_reward_model_trains_every_parameter_and_learns_style(reward_model_run, policy_dir):
    run_dir, result, sink = reward_model_run
    final = run_dir / "checkpoints" / "reward_model" / "final"
    before = load_file(policy_dir / "model.safetensors")
    after = load_file(final / "model.safetensors")
    assert_all_changed({k: v for k, v in before.items() if k in after}, after)
    assert torch.count_nonzero(after["score.weight"]) > 0  # the zero-initialised head moved
    steps = by_step(sink, "reward_model")
    # Bradley–Terry starts at ln 2 = 0.6931 exactly (zero head: every reward is 0).
    assert steps[1]["loss/reward_model"] == pytest.approx(0.6931, abs=1e-4)
    # Adam at this lr oscillates step to step; the best of the last three steps is well below ln 2.
    assert min(steps[s]["loss/reward_model"] for s in (4, 5, 6)) < 0.6931 - 0.025
    # Style pairs differ in length by a whole ramble: even a random backbone separates them.
    assert steps[6]["eval/accuracy_style"] >= 0.75
    assert "eval/accuracy_correctness" in steps[6] and "eval/gold_agreement" in steps[6]
    assert result.checkpoint == policy_dir  # hands the policy on, not the reward model


def test_reward_model_checkpoint_is_normalized_on_start_policy_samples(reward_model_run, policy_dir):
    run_dir, _, sink = reward_model_run
    final = run_dir / "checkpoints" / "reward_model" / "final"
    norm = RewardNormalization.load(final)
    last = by_step(sink, "reward_model")[6]
    assert norm.n == 16  # 4 prompts × 4 samples
    assert norm.mean == pytest.approx(last["eval/score_mean_raw"])
    assert Path(norm.policy) == policy_dir  # outside the run dir: stored absolute
    model = load_scalar_model(final)
    assert model.score.weight.shape == (1, model.config.hidden_size)


# ---- DPO family --------------------------------------------------------------------------------


def run_dpo_stage(tmp_path: Path, policy_dir: Path, tokenizer, world, **over):
    # The whole data set is one batch, so every step sees the same pairs and the trend is not batch noise.
    fields = {"steps": 4, "batch_size": 16, "grad_accum": 2, "data": [{"world": "arithmetic", "n": 16}],
              "eval_per_level": 0, "log_every": 1, "optim": FAST}
    fields.update(over)
    cfg = DPOStage(**fields)
    ctx, sink = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    result = run_dpo(cfg, ctx)
    return result, by_step(sink, "dpo")


@pytest.mark.parametrize("loss", ["dpo", "ipo", "kto", "orpo", "simpo"])
def test_dpo_family_trains_every_parameter_and_widens_the_margin(tmp_path, policy_dir, tokenizer, world, loss):
    beta = {"orpo": 0.5, "simpo": 2.0}.get(loss, 0.1)
    result, steps = run_dpo_stage(tmp_path, policy_dir, tokenizer, world, loss=loss, beta=beta, optim={**FAST, "lr": 1e-3})
    before = load_file(policy_dir / "model.safetensors")
    after = load_file(result.checkpoint / "model.safetensors")
    assert_all_changed(before, after)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen", "logps/rejected"):
        assert key in steps[4], key
    # The implicit-reward margin is what every method pushes up (KTO: desirable minus undesirable).
    assert steps[4]["rewards/margin"] > steps[1]["rewards/margin"]
    assert steps[4][f"loss/{loss}"] < steps[1][f"loss/{loss}"]
    if loss in ("dpo", "ipo", "kto"):
        # Policy = reference at step 1: every implicit reward is β·0 = 0.
        assert steps[1]["rewards/margin"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("loss", ["dpo", "kto"])
def test_cached_reference_logps_give_the_losses_of_recomputing_them(tmp_path, policy_dir, tokenizer, world, loss):
    _, cached = run_dpo_stage(tmp_path / "cached", policy_dir, tokenizer, world, loss=loss, reference="cached", steps=3)
    _, fresh = run_dpo_stage(tmp_path / "fresh", policy_dir, tokenizer, world, loss=loss, reference="recompute", steps=3)
    for step in (1, 2, 3):
        # Same data order and weights; only the padding of the reference forwards differs (batch of
        # 64 vs micro-batches of 4), so the losses agree to float32 rounding, far below one step's change.
        assert cached[step][f"loss/{loss}"] == pytest.approx(fresh[step][f"loss/{loss}"], abs=2e-5)
        assert cached[step]["rewards/margin"] == pytest.approx(fresh[step]["rewards/margin"], abs=2e-5)
    assert abs(cached[3][f"loss/{loss}"] - cached[1][f"loss/{loss}"]) > 1e-3  # the losses did move


def test_dpo_reports_skipped_pairs_from_a_file(tmp_path, policy_dir, tokenizer, world):
    rows = [{"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"},
            {"prompt": "What is 4+4?", "chosen": "8", "rejected": "8"},  # identical: skipped
            {"prompt": "What is 1+1?", "chosen": "2", "rejected": "Hmm, let me see. So we get 2"},
            {"prompt": "What is 3+1?", "chosen": " 4 ", "rejected": "4"}]  # identical after stripping: skipped
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result, steps = run_dpo_stage(tmp_path / "run", policy_dir, tokenizer, world, data=[{"path": str(path)}],
                                  batch_size=2, grad_accum=1, steps=1)
    assert steps[1]["data/skipped"] == 2.0  # rows 2 and 4
    assert result.metrics["data/skipped"] == 2.0


# ---- PPO ---------------------------------------------------------------------------------------


def test_ppo_trains_every_parameter_and_raises_the_reward(tmp_path, policy_dir, tokenizer, world):
    # A reward model whose head is a fixed random direction: a reward the policy can chase in a few
    # iterations (the real one is tested by the demo numbers in docs/preference.md).
    rm_dir = make_reward_model(tmp_path / "rm", policy_dir)
    cfg = PPOStage(reward_model=str(rm_dir), steps=12, batch_size=32, minibatch_size=8, ppo_epochs=2, max_new_tokens=6,
                   data=[{"world": "arithmetic", "n": 64}], missing_eos_score=None, kl_coef=0.01, critic_lr=3e-3,
                   eval_per_level=2, eval_samples=1, log_every=1, optim={**FAST, "lr": 1e-2})
    # 12 iterations of 32 rollouts at lr 1e-2 (AVX2 CPU, one thread): rm/score 9.79, 8.27, 11.19, … 15.36,
    # 16.05 — the last three's mean 5.6 above the first three's. Shorter or hotter runs were noise on some
    # CPUs: 8 × 16 at 3e-2 climbed to 15.5 at iteration 6 and fell back to 10.0 by 8 (KL 30 nats), and
    # 8 × 16 at 1e-2 wandered 8.5–9.9 for five iterations before it rose.
    ctx, sink = make_ctx(tmp_path / "run", policy_dir, tokenizer, world, cfg)
    result = run_ppo(cfg, ctx)
    before = load_file(policy_dir / "model.safetensors")
    after = load_file(result.checkpoint / "model.safetensors")
    assert_all_changed(before, after)
    steps = by_step(sink, "ppo")
    assert steps[1]["kl"] == pytest.approx(0.0, abs=1e-4)  # policy = reference at the first rollout
    for key in ("rm/score", "gold/reward", "kl", "entropy", "policy/clip_frac_low", "policy/clip_frac_high",
                "value/explained_variance", "response/length"):
        assert key in steps[12], key
    first, last = [steps[s]["rm/score"] for s in (1, 2, 3)], [steps[s]["rm/score"] for s in (10, 11, 12)]
    assert sum(last) / 3 > sum(first) / 3 + 1.0, (first, last)
    assert "eval/h2h/gold_reward" in steps[12]
