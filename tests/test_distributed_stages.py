"""More stages data-parallel (replicate; docs/distributed.md): the reward model, DPO and PPO on 2 gloo
ranks against one process, same recipe, same global batch. `pytest -s -m slow tests/test_distributed_stages.py`.

With as many micro-batches as ranks, each rank runs one of the very micro-batches one process runs, and
the all-reduce adds the two gradients as one process accumulates them (g0 + g1: one float addition, the
same either way), so the final weights must be bitwise equal. That is the bound tested, because these
two stages amplify round-off more than SFT: in one process, changing only grad_accum 4 → 2 (the same
gradient up to the order of additions) moved the final weights of this recipe by 4.1e-5 (reward model)
and 3.9e-4 (DPO) — 4 AdamW steps at lr 3e-3, whose first steps are ≈ lr · sign(gradient).
"""

from __future__ import annotations

import json

import pytest
from test_distributed import _write, max_diff, rows, run_one, run_ranks, weights

pytestmark = pytest.mark.usefixtures("one_thread")


def preference_recipe() -> dict:
    # reward model then DPO, both from the base: 8 pairs a step in 2 micro-batches of 4 (one process runs
    # both; each of 2 ranks runs one, then the gradients are summed); the reward model's evals and
    # normalization are small, and rank 0's alone
    data = [{"task": "arithmetic", "n": 64}]
    return {"name": "dp", "seed": 0, "threads": 1, "model": {"init": "tiny-1m", "vocab_size": 400},
            "telemetry": {"measure_cpu": False},
            "stages": [{"stage": "reward_model", "steps": 4, "batch_size": 8, "grad_accum": 2, "max_len": 96, "data": data,
                        "heldout": 8, "norm_samples": 8, "samples_per_prompt": 2, "max_new_tokens": 8, "log_every": 1,
                        "optim": {"lr": 3e-3, "warmup_steps": 1}},
                       {"stage": "dpo", "steps": 4, "batch_size": 8, "grad_accum": 2, "max_len": 96, "data": data,
                        "eval_per_level": 0, "save_every": 2, "log_every": 1, "optim": {"lr": 3e-3, "warmup_steps": 1}}]}


@pytest.mark.slow
def test_reward_model_and_dpo_two_ranks_equal_one_process(tmp_path):
    recipe = _write(tmp_path, preference_recipe())
    one, two = tmp_path / "one", tmp_path / "two"
    run_one(recipe, one)
    said = run_ranks(2, recipe, two)
    assert said.count("in 2 micro-batches (2 ranks × 1 of 4)") == 2  # both stages
    for stage in ("reward_model", "dpo"):
        diff = max_diff(weights(one, stage), weights(two, stage))
        trained, base = weights(one, stage), weights(one, "base")  # the reward model: the backbone's moves
        moved = max(float((trained[k] - base[k]).abs().max()) for k in trained.keys() & base.keys())
        print(f"\n{stage}, 4 steps: max |w(2 ranks) − w(1 process)| = {diff:.3g} (training moved weights by up to {moved:.3g})")
        assert moved > 1e-3 and diff == 0.0
    assert rows(two) == rows(one)
    # the reward model's normalization is rank 0's, as one process computes it
    assert (two / "checkpoints" / "reward_model" / "final" / "reward_norm.json").read_text() == \
        (one / "checkpoints" / "reward_model" / "final" / "reward_norm.json").read_text()


def ppo_recipe() -> dict:
    # a reward model (2 steps), then PPO: 8 rollouts an iteration (each of 2 ranks generates 4), 2 epochs
    # × 2 minibatches of 4 drawn from the whole batch, adaptive KL (the controller reads the global KL)
    data = [{"task": "arithmetic", "n": 64}]
    return {"name": "dp", "seed": 0, "threads": 1, "model": {"init": "tiny-1m", "vocab_size": 400},
            "telemetry": {"measure_cpu": False},
            "stages": [{"stage": "reward_model", "steps": 2, "batch_size": 8, "grad_accum": 2, "max_len": 96, "data": data,
                        "heldout": 8, "norm_samples": 8, "samples_per_prompt": 2, "max_new_tokens": 8, "log_every": 1},
                       {"stage": "ppo", "steps": 3, "batch_size": 8, "minibatch_size": 4, "ppo_epochs": 2, "max_new_tokens": 8,
                        "kl_target": 1.0, "eval_per_level": 0, "save_every": 10, "log_every": 1, "data": data,
                        "optim": {"lr": 3e-3, "warmup_steps": 0}}]}


@pytest.mark.slow
def test_ppo_two_ranks_equal_one_process(tmp_path):
    """PPO's rollouts are sharded, so each rank pads its own rows to its own longest prompt and reply, and
    the whitening, KL and explained-variance statistics are float64 sums over the ranks instead of one
    tensor's reductions: the 2-rank run differs from one process by round-off, which 12 AdamW steps at lr
    3e-3 amplify. Checked three ways: the samples are the same (step 1's logged lengths, exactly); step
    1's score, value loss, gradient norm and entropy agree to 1e-5 relative (measured: 6–8 digits, e.g. grad
    norm 2.9480362 vs 2.9480413), and the policy loss to 1e-6 absolute — it is the mean of whitened advantages
    (of size ~1) times ratios, ~0.025 where its terms nearly cancel, so their round-off shows at ~1e-5 of it
    (measured 2.8e-7 of 0.0249); the final weights differ by under 1% of what training moved them (measured
    1.5e-4 of 2.4e-2)."""
    recipe = _write(tmp_path, ppo_recipe())
    one, two = tmp_path / "one", tmp_path / "two"
    run_one(recipe, one)
    said = run_ranks(2, recipe, two)
    assert "2 ranks × 4 rollouts each" in said
    diff = max_diff(weights(one, "ppo"), weights(two, "ppo"))
    moved = max_diff(weights(one, "ppo"), weights(one, "base"))
    print(f"\nppo, 3 iterations: max |w(2 ranks) − w(1 process)| = {diff:.3g} (training moved weights by up to {moved:.3g})")
    first = [r for run in (one, two) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r["stage"] == "ppo" and r["step"] == 1]
    assert [{k: r[k] for k in ("response/length", "response/truncated")} for r in first] == \
        [{k: first[0][k] for k in ("response/length", "response/truncated")}] * 2  # the same samples
    for k in ("rm/score", "loss/value", "train/grad_norm", "entropy"):
        assert abs(first[0][k] - first[1][k]) <= 1e-5 * abs(first[0][k]), (k, first[0][k], first[1][k])
    assert abs(first[0]["loss/policy"] - first[1]["loss/policy"]) <= 1e-6, (first[0]["loss/policy"], first[1]["loss/policy"])
    assert rows(two) == rows(one)
    assert moved > 1e-3 and diff < 0.01 * moved
