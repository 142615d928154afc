"""More stages data-parallel (replicate; docs/distributed.md): the reward model and DPO on 2 gloo ranks
against one process, same recipe, same global batch. `pytest -s -m slow tests/test_distributed_stages.py`.

With as many micro-batches as ranks, each rank runs one of the very micro-batches one process runs, and
the all-reduce adds the two gradients as one process accumulates them (g0 + g1: one float addition, the
same either way), so the final weights must be bitwise equal. That is the bound tested, because these
two stages amplify round-off more than SFT: in one process, changing only grad_accum 4 → 2 (the same
gradient up to the order of additions) moved the final weights of this recipe by 4.1e-5 (reward model)
and 3.9e-4 (DPO) — 4 AdamW steps at lr 3e-3, whose first steps are ≈ lr · sign(gradient).
"""

from __future__ import annotations

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
