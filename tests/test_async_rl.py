"""Asynchronous GRPO (docs/async_rl.md): the off-policy correction's math by hand, the sampler/learner
mismatch, the doctor's importance-weight rule, and the stage at k = 1 and 2 on tiny-1m — staleness as
designed, deterministic (bitwise), and an exact resume from a step checkpoint."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from posttrain.doctor import Severity, StageStream
from posttrain.doctor.rules_rl import importance_weight_drift
from posttrain.losses import decoupled_ppo_loss, ppo_clip_loss, sampler_mismatch, truncated_is_weights
from posttrain.rewards import WeightedVerifier
from posttrain.runtime.config import GRPOStage
from posttrain.stages import grpo as grpo_mod
from posttrain.stages._async_rollout import AsyncRollouts, behaviour_version
from posttrain.stages.grpo import run_grpo
from test_rlvr_grpo import _digits, make_ctx

LN = math.log


# ---- the correction, by hand -------------------------------------------------------------------------
def test_truncated_is_weights_by_hand():
    behav = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    prox = behav + torch.tensor([[LN(1.5), LN(4.0), -LN(2.0), 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    w, st = truncated_is_weights(prox, behav, mask, cap=2.0)
    # ratios 1.5, 4 → capped at 2, 0.5; the masked token gets 0 (its e^5 never counts)
    torch.testing.assert_close(w, torch.tensor([[1.5, 2.0, 0.5, 0.0]]), atol=1e-6, rtol=0)
    f = st.as_floats()
    assert f["is_weight_mean"] == pytest.approx(4.0 / 3, abs=1e-6)      # (1.5 + 2 + 0.5) / 3
    assert f["is_truncated_frac"] == pytest.approx(1.0 / 3, abs=1e-6)   # only the 4
    assert f["log_ratio_abs_mean"] == pytest.approx((LN(1.5) + LN(4) + LN(2)) / 3, abs=1e-6)  # 0.828302


def test_decoupled_loss_by_hand():
    behav = torch.tensor([[-1.0, -2.0, -0.5]])
    prox = behav + torch.tensor([[LN(1.5), LN(4.0), -LN(2.0)]])
    # token 0: π_θ = π_prox (r = 1); token 1: r = e^0.5 = 1.6487; token 2: r = e^−0.5 = 0.6065
    lp = (prox + torch.tensor([[0.0, 0.5, -0.5]])).requires_grad_(True)
    adv = torch.tensor([[1.0], [-1.0]])[:1]  # A = +1 for the sequence
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats, _ = decoupled_ppo_loss(lp, prox, behav, adv, mask, clip_low=0.2, clip_high=0.2, is_cap=2.0)
    # w = (1.5, 2, 0.5); t0: −1.5·1 = −1.5; t1: r clipped to 1.2 (A > 0) → −2·1.2 = −2.4;
    # t2: min(0.6065, 0.8) = 0.6065 (the unclipped term is the smaller) → −0.5·0.6065 = −0.30327
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.5, -2.4, -0.5 * math.exp(-0.5)]]), atol=1e-5, rtol=0)
    loss.sum().backward()
    # d/d log π_θ of −w·r·A = −w·r: t0 −1.5; t1 0 (clipped); t2 −0.5·0.6065 = −0.30327
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.5, 0.0, -0.5 * math.exp(-0.5)]]), atol=1e-5, rtol=0)
    assert stats.as_floats()["clip_frac_high"] == pytest.approx(1 / 3, abs=1e-6)  # the clip is against π_prox


def test_decoupled_loss_is_ppo_when_prox_is_behaviour():
    g = torch.Generator().manual_seed(0)
    lp, old = -torch.rand(3, 5, generator=g) * 3, -torch.rand(3, 5, generator=g) * 3
    adv, mask = torch.randn(3, 1, generator=g), torch.rand(3, 5, generator=g) > 0.3
    a, _ = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    b, _, st = decoupled_ppo_loss(lp, old, old, adv, mask, clip_low=0.2, clip_high=0.28, is_cap=2.0)
    assert torch.equal(a, b)  # every weight is exactly 1: e^0 = 1
    assert st.as_floats()["is_weight_mean"] == 1.0


def test_sampler_mismatch_by_hand():
    behav = torch.tensor([[-1.0, -2.0, -7.0]])
    lp = behav + torch.tensor([[0.1, -0.2, 9.0]])
    m = sampler_mismatch(lp, behav, torch.tensor([[1, 1, 0]], dtype=torch.bool)).as_floats()
    assert m["logprob_abs_mean"] == pytest.approx(0.15, abs=1e-6)  # (0.1 + 0.2) / 2; the masked 9 is out
    # k3 = (e^0.1 − 1 − 0.1 + e^−0.2 − 1 + 0.2) / 2 = (0.0051709 + 0.0187308) / 2 = 0.0119508
    assert m["kl"] == pytest.approx(0.0119508, abs=1e-6)


def test_behaviour_version_and_config():
    assert [behaviour_version(i, 2) for i in range(5)] == [0, 0, 0, 1, 2]  # staleness 0, 1, 2, 2, 2
    data = [{"task": "arithmetic", "n": 8}]
    assert GRPOStage(data=data).correction == "none"
    assert GRPOStage(data=data, max_staleness=1).correction == "decoupled"
    assert GRPOStage(data=data, off_policy="tis").correction == "tis"
    with pytest.raises(ValueError, match="tis corrects the sampler/learner mismatch"):
        GRPOStage(data=data, max_staleness=1, off_policy="tis")


# ---- the producer, with a fake engine -------------------------------------------------------------
class _Engine:
    """Records the weight it was synced to (a 1×1 linear layer whose weight is the version number)."""

    def __init__(self):
        self.weight, self.synced = 0.0, []

    def sync_weights(self, state):
        self.weight = float(state["weight"])
        self.synced.append(self.weight)
        return 4

    def release_memory(self):
        return 0


def _producer(k: int, n: int, produce) -> tuple[AsyncRollouts, _Engine]:
    from contextlib import nullcontext
    from types import SimpleNamespace

    engine = _Engine()
    return AsyncRollouts(engine=engine, max_staleness=k, n_rollouts=n, first_index=0, engine_version=0,
                         produce=lambda i, v: produce(engine, i, v), data_state=lambda: {},
                         phase=lambda name, step: nullcontext(SimpleNamespace(cost=None)), step_of=lambda i: i + 1), engine


def test_producer_samples_each_rollout_with_its_version():
    model = torch.nn.Linear(1, 1, bias=False)
    rollouts, engine = _producer(2, 6, lambda e, i, v: ((i, v, e.weight), {}))
    for i in range(6):
        item, _ = rollouts.get(i)
        # the engine held version max(0, i − 2) when it sampled rollout i
        assert item.batch == (i, max(0, i - 2), float(max(0, i - 2))) and item.version == max(0, i - 2)
        with torch.no_grad():
            model.weight.fill_(i + 1.0)  # "update i" makes version i + 1
        copied = rollouts.publish(i + 1, model)
        assert copied == (4 if i + 1 + 2 < 6 else 0)  # versions 4, 5, 6 sample nothing: not copied
    rollouts.close()
    assert engine.synced == [1.0, 2.0, 3.0]  # rollouts 3, 4, 5 (rollouts 0–2 are version 0, the engine's own)


def test_producer_failure_reaches_the_learner():
    def produce(engine, i, v):
        if i == 1:
            raise OSError("verifier sandbox died")
        return None, {}

    rollouts, _ = _producer(1, 4, produce)
    rollouts.get(0)
    with pytest.raises(RuntimeError, match="rollout thread failed: OSError: verifier sandbox died"):
        rollouts.get(1)  # raised, not a hang
    rollouts.close()


# ---- the doctor --------------------------------------------------------------------------------------
def _stream(**curves: list[float]) -> StageStream:
    n = max(len(v) for v in curves.values())
    recs = [{"stage": "grpo", "step": s} for s in range(1, n + 1)]
    for name, values in curves.items():
        for r, v in zip(recs, values):
            r[name.replace("__", "/")] = v
    return StageStream("grpo", "grpo", {"max_staleness": 2}, recs)


def test_importance_weight_drift():
    flat_trunc = [0.0] * 10
    # mean weight 1.0 → end median of the last three 0.75: |0.75 − 1| = 0.25 ≥ 0.2 → warning
    w = [1.0, 1.0, 1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.75, 0.75]
    f = importance_weight_drift(_stream(offpolicy__is_weight_mean=w, offpolicy__is_truncated_frac=flat_trunc))
    assert len(f) == 1 and f[0].severity == Severity.WARNING and "lower max_staleness" in f[0].mitigation
    # end 0.45: |−0.55| ≥ 0.5 → critical
    w = [1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.45, 0.45, 0.45]
    f = importance_weight_drift(_stream(offpolicy__is_weight_mean=w, offpolicy__is_truncated_frac=flat_trunc))
    assert f[0].severity == Severity.CRITICAL
    # weights near 1 but the capped share climbs 0 → 0.1 (≥ 5%, noise 0 for a clean ramp) → warning
    trunc = [0.0, 0.0, 0.0, 0.02, 0.04, 0.06, 0.08, 0.1, 0.1, 0.1]
    f = importance_weight_drift(_stream(offpolicy__is_weight_mean=[1.02] * 10, offpolicy__is_truncated_frac=trunc))
    assert f[0].severity == Severity.WARNING
    # healthy: mean 0.9 (|−0.1| < 0.2), 1% capped → silent; a sync run without the metric → silent
    assert importance_weight_drift(_stream(offpolicy__is_weight_mean=[0.9] * 10,
                                           offpolicy__is_truncated_frac=[0.01] * 10)) == []
    assert importance_weight_drift(_stream(reward__total=[0.5] * 10)) == []


# ---- the stage on tiny-1m ----------------------------------------------------------------------------
def _cfg(k: int, **kw) -> GRPOStage:
    base = dict(steps=4, batch_size=16, group_size=4, max_new_tokens=8, log_every=1, save_every=8, loss="dapo",
                max_staleness=k, data=[{"world": "arithmetic", "n": 200}],
                optim={"lr": 2e-2, "warmup_steps": 0, "min_lr_ratio": 1.0})
    return GRPOStage(**{**base, **kw})


@pytest.fixture
def digits(monkeypatch):
    monkeypatch.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])


@pytest.mark.slow
def test_async_runs_stale_as_designed_and_deterministic(tmp_path, policy_dir, tokenizer, world, digits):
    finals, recs = {}, {}
    for name, k in (("k1", 1), ("k2", 2), ("k2_again", 2)):
        ctx, sink = make_ctx(tmp_path / name, policy_dir, tokenizer, world, _cfg(k))
        finals[name] = load_file(run_grpo(_cfg(k), ctx).checkpoint / "model.safetensors")
        recs[name] = [r for r in sink.records if r["stage"] == "grpo"]
    for name, k in (("k1", 1), ("k2", 2)):
        r = recs[name]
        assert [x["step"] for x in r] == [1, 2, 3, 4]
        # rollout i is sampled by version max(0, i − k): staleness min(i, k) — k from rollout k on
        assert [x["async/staleness_mean"] for x in r] == [min(i, k) for i in range(4)]
        assert [x["async/staleness_max"] for x in r] == [min(i, k) for i in range(4)]
        for x in r:
            assert math.isfinite(x["offpolicy/is_weight_mean"]) and 0 <= x["offpolicy/is_truncated_frac"] <= 1
            assert x["async/wait_learner_s"] >= 0 and x["async/wait_rollout_s"] >= 0
        # rollout 0 is on-policy (version 0 = the start weights): every weight is 1 up to kernel round-off
        assert r[0]["offpolicy/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert r[0]["mismatch/logprob_abs_mean"] < 1e-4
        # a stale rollout: the learner has moved (lr 2e-2), so π_prox ≠ π_behav
        assert r[-1]["offpolicy/log_ratio_abs_mean"] > 1e-3
    assert all(torch.equal(finals["k2"][n], finals["k2_again"][n]) for n in finals["k2"])  # bitwise determinism
    assert any(not torch.equal(finals["k1"][n], finals["k2"][n]) for n in finals["k1"])    # k matters


@pytest.mark.slow
def test_async_resume_from_step_checkpoint_is_exact(tmp_path, policy_dir, tokenizer, world, digits):
    cfg = _cfg(2, steps=6, save_every=2, keep_last=5)
    ctx, _ = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    straight = load_file(run_grpo(cfg, ctx).checkpoint / "model.safetensors")
    stage_dir = tmp_path / "checkpoints" / "grpo"
    for name in ("final", "step-000004"):  # as if killed right after the step-2 checkpoint
        shutil.rmtree(stage_dir / name)
    ctx, sink = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    torch.manual_seed(123)  # the resumed run must not depend on the global RNG it finds
    resumed = load_file(run_grpo(cfg, ctx).checkpoint / "model.safetensors")
    assert [r["step"] for r in sink.records if r["stage"] == "grpo"] == [3, 4, 5, 6]
    assert all(torch.equal(straight[n], resumed[n]) for n in straight)
    with pytest.raises(ValueError, match="max_staleness 2"):  # another k cannot resume it exactly
        shutil.rmtree(stage_dir / "final")
        run_grpo(_cfg(1, steps=6, save_every=2, keep_last=5), make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)[0])
