"""Asynchronous PPO (docs/async_rl.md, the PPO section): the shared config fields and their refusals, the
synchronous loop untouched at k = 0, and the stage at k = 1 and 2 on tiny-1m — staleness min(i, k) per
iteration, the correction's stats, bitwise determinism and an exact resume from a step checkpoint."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from posttrain.distributed import DistributedError
from posttrain.runtime.config import AsyncRLFields, GRPOStage, PPOStage
from posttrain.stages import ppo as ppo_mod
from posttrain.stages.ppo import data_parallel_problem, run_ppo
from conftest import make_ctx, make_reward_model

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = [{"task": "arithmetic", "n": 64}]


def _cfg(rm, k: int, **over) -> PPOStage:
    # 16 rollouts × 6 tokens, 2 epochs × 2 minibatches: ~1 s per iteration on tiny-1m. lr 1e-2 moves the
    # policy enough in one iteration that a stale rollout's π_behav differs from π_prox measurably.
    d = dict(reward_model=str(rm), steps=4, batch_size=16, minibatch_size=8, ppo_epochs=2, max_new_tokens=6, data=DATA,
             kl_coef=0.05, critic_lr=3e-3, eval_per_level=0, log_every=1, save_every=2,
             optim={"lr": 1e-2, "warmup_steps": 1, "min_lr_ratio": 1.0}, max_staleness=k)
    return PPOStage(**{**d, **over})


# ---- the config ----------------------------------------------------------------------------------------
def test_async_fields_are_shared_with_grpo():
    # one definition: both stages inherit it (a copy would drift)
    for f in ("max_staleness", "off_policy", "is_cap"):
        assert f in AsyncRLFields.__annotations__
        assert f not in PPOStage.__annotations__ and f not in GRPOStage.__annotations__
        assert PPOStage.model_fields[f].description == GRPOStage.model_fields[f].description
    assert issubclass(PPOStage, AsyncRLFields) and issubclass(GRPOStage, AsyncRLFields)
    assert PPOStage(data=DATA).correction == "none"             # k = 0: the synchronous loop's loss
    assert PPOStage(data=DATA, max_staleness=1).correction == "decoupled"
    assert PPOStage(data=DATA, max_staleness=2, off_policy="none").correction == "none"
    with pytest.raises(ValueError, match="off_policy: tis"):  # tis is for fresh rollouts only
        PPOStage(data=DATA, max_staleness=1, off_policy="tis")


def test_async_ppo_refused_data_parallel():
    assert data_parallel_problem(PPOStage(data=DATA, batch_size=16, minibatch_size=8), 2) is None
    msg = data_parallel_problem(PPOStage(data=DATA, batch_size=16, minibatch_size=8, max_staleness=1), 2)
    assert msg is not None and "max_staleness 1" in msg and "data-parallel" in msg and "ppo" in msg
    assert data_parallel_problem(PPOStage(data=DATA, batch_size=16, minibatch_size=8, off_policy="decoupled"), 2) is not None


def test_k0_runs_the_synchronous_loop(tmp_path, policy_dir, tokenizer, world, monkeypatch):
    # k = 0 never starts a rollout thread nor logs async/offpolicy keys. Bitwise: a 4-step run of this _cfg(…, 0)
    # gave the same sha256 of its final policy (f6345cb9…) before and after async PPO (docs/async_rl.md)
    def refuse(*a, **kw):
        raise AssertionError("k = 0 must not start a rollout thread")
    monkeypatch.setattr(ppo_mod, "AsyncRollouts", refuse)
    rm = make_reward_model(tmp_path / "rm", policy_dir)
    cfg = _cfg(rm, 0, steps=2)
    ctx, sink = make_ctx(tmp_path / "run", policy_dir, tokenizer, world, cfg)
    run_ppo(cfg, ctx)
    recs = [r for r in sink.records if r["stage"] == "ppo"]
    assert [r["step"] for r in recs] == [1, 2]
    assert not any(k.startswith(("async/", "offpolicy/", "mismatch/")) for r in recs for k in r)


# ---- the stage at k = 1 and 2 --------------------------------------------------------------------------
@pytest.mark.slow
def test_async_ppo_stale_as_designed_and_deterministic(tmp_path, policy_dir, tokenizer, world):
    rm = make_reward_model(tmp_path / "rm", policy_dir)
    finals, recs = {}, {}
    for name, k in (("k1", 1), ("k2", 2), ("k2_again", 2)):
        cfg = _cfg(rm, k)
        ctx, sink = make_ctx(tmp_path / name, policy_dir, tokenizer, world, cfg)
        finals[name] = load_file(run_ppo(cfg, ctx).checkpoint / "model.safetensors")
        recs[name] = [r for r in sink.records if r["stage"] == "ppo"]
    for name, k in (("k1", 1), ("k2", 2)):
        r = recs[name]
        assert [x["step"] for x in r] == [1, 2, 3, 4]
        # iteration i (0-based) trains on a rollout of version max(0, i − k): staleness min(i, k)
        assert [x["async/staleness_mean"] for x in r] == [min(i, k) for i in range(4)]
        assert [x["async/staleness_max"] for x in r] == [min(i, k) for i in range(4)]
        assert [x["async/version"] for x in r] == [max(0, i - k) for i in range(4)]
        for x in r:
            assert math.isfinite(x["offpolicy/is_weight_mean"]) and 0 <= x["offpolicy/is_truncated_frac"] <= 1
            assert x["async/wait_learner_s"] >= 0 and x["async/wait_rollout_s"] >= 0
        # rollout 0 is on-policy (version 0 = the start weights): π_prox = π_behav up to kernel round-off
        assert r[0]["offpolicy/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert r[0]["mismatch/logprob_abs_mean"] < 1e-4
        # the last rollout is k iterations stale and the learner has moved (lr 1e-2): π_prox ≠ π_behav
        assert r[-1]["offpolicy/log_ratio_abs_mean"] > 1e-3
        # (the mismatch is over the whole batch, offpolicy/* a mean of the minibatches' token means: close, not equal)
        assert r[-1]["mismatch/logprob_abs_mean"] > 1e-3 and r[-1]["mismatch/kl"] > 0
        assert r[-1]["offpolicy/is_weight_mean"] != 1.0
    assert all(torch.equal(finals["k2"][n], finals["k2_again"][n]) for n in finals["k2"])  # bitwise determinism
    assert any(not torch.equal(finals["k1"][n], finals["k2"][n]) for n in finals["k1"])    # k matters


@pytest.mark.slow
def test_async_ppo_resume_from_step_checkpoint_is_exact(tmp_path, policy_dir, tokenizer, world):
    rm = make_reward_model(tmp_path / "rm", policy_dir)
    cfg = _cfg(rm, 2, steps=6, save_every=2, keep_last=5)
    ctx, _ = make_ctx(tmp_path / "run", policy_dir, tokenizer, world, cfg)
    straight = load_file(run_ppo(cfg, ctx).checkpoint / "model.safetensors")
    stage_dir = tmp_path / "run" / "checkpoints" / "ppo"
    for name in ("final", "step-000004"):  # as if killed right after the step-2 checkpoint
        shutil.rmtree(stage_dir / name)
    ctx, sink = make_ctx(tmp_path / "run", policy_dir, tokenizer, world, cfg)
    torch.manual_seed(123)  # the resumed run must not depend on the global RNG it finds
    resumed = load_file(run_ppo(cfg, ctx).checkpoint / "model.safetensors")
    r = [x for x in sink.records if x["stage"] == "ppo"]
    assert [x["step"] for x in r] == [3, 4, 5, 6]
    assert [x["async/version"] for x in r] == [0, 1, 2, 3]  # the saved rollouts 2 and 3 (versions 0, 1) first
    assert all(torch.equal(straight[n], resumed[n]) for n in straight)
    shutil.rmtree(stage_dir / "final")
    with pytest.raises(ValueError, match="max_staleness 2"):  # another k cannot resume it exactly
        run_ppo(_cfg(rm, 1, steps=6, save_every=2, keep_last=5), make_ctx(tmp_path / "run", policy_dir, tokenizer, world, cfg)[0])
