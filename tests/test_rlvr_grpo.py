"""The grpo stage: the loss variants by hand, group bookkeeping, the on-policy ratio invariant,
dynamic sampling's bound and waste count, a tiny-model smoke run, and exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.data import EpochSampler, encode_prompt
from posttrain.losses import AGGREGATIONS, loss_normalizer
from posttrain.models import kept_columns, load_model
from posttrain.runtime.config import GRPOStage, Recipe
from posttrain.runtime.context import RunContext
from posttrain.rewards import WeightedVerifier
from posttrain.rollout import NativeEngine, SamplingParams, make_engine
from posttrain.stages import grpo as grpo_mod
from posttrain.stages._rlvr import (
    encode_problems,
    group_keep,
    load_problems,
    world_gold,
)
from posttrain.losses import GRPO_VARIANTS, GRPOLoss, grpo_token_loss
from posttrain.stages.grpo import build_batch, collect_groups, completion_logprobs, run_grpo
from posttrain.telemetry import Telemetry
from conftest import ListSink, world_tasks


def make_ctx(run_dir: Path, start: Path, tokenizer, world, stage) -> tuple[RunContext, ListSink]:
    torch.manual_seed(0)
    recipe = Recipe(stages=[stage], threads=1, evals=[{"task": "arithmetic", "levels": ["L2"], "max_new_tokens": 16}])
    sink = ListSink()
    return RunContext(run_dir=run_dir, recipe=recipe, device=torch.device("cpu"), tokenizer=tokenizer, tasks=world_tasks(world),
                      telemetry=Telemetry.disabled(), sink=sink, start=start), sink


# ---- the loss variants, by hand ----------------------------------------------------------------
def test_variant_table():
    # GRPO: std-normalized advantage, per-sequence mean; DAPO: clip-higher, token mean; Dr. GRPO: no std, constant norm
    assert (GRPO_VARIANTS[GRPOLoss.GRPO].clip_low, GRPO_VARIANTS[GRPOLoss.GRPO].clip_high) == (0.2, 0.2)
    assert (GRPO_VARIANTS[GRPOLoss.DAPO].clip_low, GRPO_VARIANTS[GRPOLoss.DAPO].clip_high) == (0.2, 0.28)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # mean 0.25; unbiased std = sqrt((0.75² + 3·0.25²)/3) = sqrt(0.25) = 0.5 → (1.5, −0.5, −0.5, −0.5)
    torch.testing.assert_close(GRPO_VARIANTS[GRPOLoss.GRPO].advantages(rewards, group_size=4),
                               torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)
    torch.testing.assert_close(GRPO_VARIANTS[GRPOLoss.DAPO].advantages(rewards, group_size=4),
                               torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)
    # Dr. GRPO: r − mean → (0.75, −0.25, −0.25, −0.25)
    torch.testing.assert_close(GRPO_VARIANTS[GRPOLoss.DR_GRPO].advantages(rewards, group_size=4),
                               torch.tensor([0.75, -0.25, -0.25, -0.25]))
    # Aggregations on two sequences of 1 and 3 tokens, per-token loss 1 (seq 0) and 2 (seq 1), L_max = 4:
    loss = torch.tensor([[1.0, 0, 0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    norm = loss_normalizer(mask, constant_length=4)
    agg = {k: float(AGGREGATIONS[v.aggregation](loss, mask, norm)) for k, v in GRPO_VARIANTS.items()}
    assert agg[GRPOLoss.GRPO] == pytest.approx(1.5)     # (1/1 + 6/3) / 2 = 1.5
    assert agg[GRPOLoss.DAPO] == pytest.approx(1.75)    # (1 + 6) / 4 tokens = 1.75
    assert agg[GRPOLoss.DR_GRPO] == pytest.approx(0.875)  # (1 + 6) / (2 · 4) = 0.875


def test_token_loss_with_kl_by_hand():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    mask = torch.tensor([[1, 1]], dtype=torch.bool)
    loss, kl, _ = grpo_token_loss(lp, old, ref, torch.tensor([2.0]), mask, clip_low=0.2, clip_high=0.28, kl_coef=0.1)
    # ratio 1 → surrogate −A = −2 per token; k3 at t0: log r = −0.5, e^−0.5 − 1 + 0.5 = 0.10653; at t1: 0
    torch.testing.assert_close(kl, torch.tensor([[0.10653, 0.0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-2 + 0.010653, -2.0]]), atol=1e-5, rtol=0)
    # without a reference: no KL term, zeros reported
    loss0, kl0, _ = grpo_token_loss(lp, old, None, torch.tensor([2.0]), mask, clip_low=0.2, clip_high=0.28, kl_coef=0.1)
    torch.testing.assert_close(loss0.detach(), torch.tensor([[-2.0, -2.0]]))
    assert float(kl0.abs().sum()) == 0.0
    # ratio e^0.5 = 1.6487 > 1.28 with A > 0: clipped (clip-higher), the token's gradient is zero
    lp2 = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    loss2, _, stats2 = grpo_token_loss(lp2, old, None, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    loss2.sum().backward()
    assert lp2.grad[0, 0] == 0.0 and lp2.grad[0, 1] == pytest.approx(-1.0)  # d(−r·A)/d logp = −r·A = −1 at r = 1
    assert float(stats2.clip_frac_high) == pytest.approx(0.5)  # 1 of 2 tokens


def test_group_keep():
    total = [1.0, 1.0, 0.0, 1.0,  0.0, 0.0, 0.0, 0.0,  None, 1.0, 0.0, 1.0]
    judged, varied, missing = group_keep(total, 4)
    assert judged.tolist() == [True, True, False]     # group 2 has a None
    assert varied.tolist() == [True, False, False]    # group 1 is all 0
    assert missing.tolist() == [False, False, True]
    with pytest.raises(ValueError, match="groups of 4"):
        group_keep([1.0] * 6, 4)


def test_world_gold_verifier():
    out = world_gold(["<think>1+2=3</think> 3", "3", "The result should be 3", "4", "3"], answer=["3", "3", "3", "3", "x"])
    # concise correct 1.0 (twice); rambling body "The result should be" = 20 characters → 1 − 0.20 = 0.80; wrong 0; bad gold None
    assert out[:4] == [1.0, 1.0, pytest.approx(0.80), 0.0]
    assert out[4] is None and out.reasons[4] is not None


# ---- the batch: on-policy ratio is 1 ------------------------------------------------------------
def test_teacher_forced_logprobs_match_sampling_time(policy_dir, tokenizer, world):
    model = load_model(policy_dir)
    engine = make_engine("native", model, tokenizer)
    problems = world.problems(6, levels=["L1", "L3"])  # prompts of different lengths → left padding differs
    prompts = [encode_prompt(p["prompt"], tokenizer) for p in problems]
    ro_a = engine.generate(prompts[:3], SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=1))
    ro_b = engine.generate(prompts[3:], SamplingParams(n=2, temperature=1.0, max_new_tokens=7, seed=2))
    b = build_batch([(ro_a, [0, 1, 4], torch.tensor([1.0, -1.0, 0.5])), (ro_b, [2, 3], torch.tensor([0.3, -0.3]))],
                    engine.pad_id, mask_truncated=False)
    assert len(b) == 5 and b.advantages.tolist() == pytest.approx([1.0, -1.0, 0.5, 0.3, -0.3])
    assert b.mask.sum(1).tolist() == ro_a.completion_lengths[[0, 1, 4]].tolist() + ro_b.completion_lengths[[2, 3]].tolist()
    with torch.no_grad():
        lp = completion_logprobs(model, b)
    # the rollout's policy_logprobs are what a teacher-forced forward of the same weights gives: ratio = 1
    torch.testing.assert_close(lp * b.mask, b.old_logprobs, atol=2e-4, rtol=0)
    trunc = build_batch([(ro_a, [0, 1], torch.zeros(2))], engine.pad_id, mask_truncated=True)
    for row, r in enumerate([0, 1]):  # DAPO overlong filtering: a truncated sample has no loss tokens
        assert bool(trunc.mask[row].any()) == (ro_a.finish_reason[r] == "stop")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_forward_equals_the_padded_one(policy_dir, tokenizer, world, attention):
    """`share_prompt`: groups packed as [prompt | c_1 | … | c_G], every completion at its own length, give
    the padded forward's completion log-probs, entropies and gradients (mixed prompt and completion
    lengths, EOS-ended and truncated samples, a split group)."""
    model = load_model(policy_dir, attention=attention)
    engine = make_engine("native", model, tokenizer)
    problems = world.problems(3, levels=["L1", "L3", "L4"])
    prompts = [encode_prompt(p["prompt"], tokenizer) for p in problems]
    ro = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3))
    b = build_batch([(ro, list(range(4)), torch.zeros(4)), (ro, [4, 5, 6], torch.zeros(3)), (ro, [8, 9, 10, 11], torch.zeros(4))],
                    engine.pad_id, mask_truncated=False)
    # completions of many lengths, so that the packing is ragged: cut row r after cuts[r] tokens
    for r, k in enumerate([12, 3, 7, 1, 12, 5, 2, 9, 12, 4, 6]):
        b.input_ids[r, b.prompt_len + k :] = engine.pad_id
        b.attention_mask[r, b.prompt_len + k :] = False
        b.mask[r, k:] = False

    def run(share: bool):
        model.zero_grad(set_to_none=True)
        lp, ent = completion_logprobs(model, b, share_prompt=share, entropy=True)
        (lp * b.mask).sum().backward()
        return (lp * b.mask).detach(), ent * b.mask, {n: p.grad.clone() for n, p in model.named_parameters()}

    padded, h_padded, g_padded = run(False)
    shared, h_shared, g_shared = run(True)
    torch.testing.assert_close(shared, padded, atol=1e-4, rtol=0)
    torch.testing.assert_close(h_shared, h_padded, atol=1e-4, rtol=0)
    for n, g in g_padded.items():
        torch.testing.assert_close(g_shared[n], g, atol=2e-4, rtol=1e-3, msg=n)


# ---- dynamic sampling -----------------------------------------------------------------------------
def _collect(ctx, cfg, policy_dir, tokenizer, verifier):
    model = load_model(policy_dir)
    engine = make_engine("native", model, tokenizer)
    problems = load_problems(ctx, cfg.data, levels=None)
    prompts = encode_problems(problems, tokenizer, 64)
    sampler = EpochSampler(len(problems), 1, seed=0)
    return collect_groups(ctx, cfg, engine, [WeightedVerifier("v", verifier)], GRPO_VARIANTS[GRPOLoss.DAPO],
                          problems, prompts, sampler, step=1)


def test_dynamic_sampling_bounded_and_counted(tmp_path, policy_dir, tokenizer, world):
    cfg = GRPOStage(steps=1, batch_size=16, group_size=4, max_new_tokens=6, dynamic_sampling=True, max_rounds=3,
                    data=[{"world": "arithmetic", "n": 64}])
    ctx, _ = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    # constant reward: every group has zero variance → nothing kept after the bound, all of it waste
    got = _collect(ctx, cfg, policy_dir, tokenizer, lambda c, **_: [1.0] * len(c))
    m = got.metrics
    assert got.pieces == []
    assert m["dynamic/rounds"] == 3 and m["dynamic/kept_groups"] == 0 and m["dynamic/short_groups"] == 4
    # round 0 draws 4 prompts; then keep rate 0 → ceil(4 / max(0, 1/4)) = 16 capped at 4 → 4 + 4 + 4 = 12 groups
    assert m["dynamic/generated_groups"] == 12 and m["dynamic/waste_frac"] == 1.0
    assert m["groups/zero_variance_frac"] == 1.0
    # reward = 1 for an even-length completion: mixed groups are kept, never more than the batch holds
    got = _collect(ctx, cfg, policy_dir, tokenizer, lambda c, **_: [float(len(x) % 2 == 0) for x in c])
    kept = [(ro, rows) for ro, rows, _ in got.pieces]
    assert 0 < len(kept) <= 4
    for ro, rows in kept:
        scores = {len(ro.texts[r]) % 2 == 0 for r in rows}
        assert scores == {True, False}  # every kept group has both rewards
    m = got.metrics
    assert m["dynamic/waste_frac"] == pytest.approx(1 - m["dynamic/kept_groups"] / m["dynamic/generated_groups"])


# ---- the stage on a tiny model --------------------------------------------------------------------
def _digits(completions: list[str], **_) -> list[float]:
    """A reward a random tiny model can learn in a few steps: the share of characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, policy_dir, tokenizer, world):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])
        cfg = GRPOStage(steps=8, batch_size=16, group_size=4, max_new_tokens=8, log_every=1, save_every=8,
                        loss="dapo", kl_coef=0.05, data=[{"world": "arithmetic", "n": 200}],
                        optim={"lr": 2e-2, "warmup_steps": 0, "min_lr_ratio": 1.0})
        ctx, sink = make_ctx(tmp_path_factory.mktemp("grpo_run"), policy_dir, tokenizer, world, cfg)
        return run_grpo(cfg, ctx), sink


def test_smoke_learns_and_changes_every_parameter(smoke, policy_dir):
    result, sink = smoke
    recs = [r for r in sink.records if r["stage"] == "grpo"]
    assert [r["step"] for r in recs] == list(range(1, 9))
    first = sum(r["reward/digits"] for r in recs[:3]) / 3
    last = sum(r["reward/digits"] for r in recs[-3:]) / 3
    assert last > first + 0.1, (first, last)  # the share of digits the policy writes went up (measured: 0.03 → 0.87)
    for key in ("kl", "entropy", "clip/low", "clip/high", "groups/zero_variance_frac", "response/length_mean",
                "response/clipped_ratio", "reward/pass_rate", "train/grad_norm", "dynamic/waste_frac"):
        assert all(math.isfinite(r[key]) for r in recs), key
    assert recs[-1]["kl"] > 0  # the policy left the reference
    before = load_file(policy_dir / "model.safetensors")
    after = load_file(result.checkpoint / "model.safetensors")
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged


def test_resume_after_kill_is_exact(tmp_path, policy_dir, tokenizer, world, monkeypatch):
    def cfg_():
        return GRPOStage(steps=4, batch_size=8, group_size=4, max_new_tokens=8, save_every=2, log_every=1, mu=2,
                         data=[{"world": "arithmetic", "n": 40}], optim={"lr": 1e-2, "warmup_steps": 0})
    monkeypatch.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])
    ctx, _ = make_ctx(tmp_path / "straight", policy_dir, tokenizer, world, cfg_())
    straight = run_grpo(cfg_(), ctx).checkpoint

    class Killed(Exception):
        pass

    orig_save = grpo_mod.save

    def save_then_die(*args, **kw):
        orig_save(*args, **kw)
        raise Killed  # killed right after the step-2 checkpoint (one rollout of μ = 2 steps)

    monkeypatch.setattr(grpo_mod, "save", save_then_die)
    ctx, _ = make_ctx(tmp_path / "killed", policy_dir, tokenizer, world, cfg_())
    with pytest.raises(Killed):
        run_grpo(cfg_(), ctx)
    monkeypatch.setattr(grpo_mod, "save", orig_save)
    ctx, _ = make_ctx(tmp_path / "killed", policy_dir, tokenizer, world, cfg_())
    torch.manual_seed(123)  # the resumed run must not depend on the global RNG it finds
    resumed = run_grpo(cfg_(), ctx).checkpoint
    assert (tmp_path / "killed" / "checkpoints" / "grpo" / "step-000002").is_dir()
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


DATA = [{"task": "arithmetic", "n": 8}]


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of group_size"):
        GRPOStage(batch_size=30, group_size=8, data=DATA)
    with pytest.raises(ValueError, match="multiples of mu"):
        GRPOStage(steps=5, mu=2, data=DATA)


def test_stage_with_shared_prompts_stays_on_policy(tmp_path, policy_dir, tokenizer, world, monkeypatch):
    """The whole stage with `share_prompt` (micro-batches, KL reference): with μ = 1 the importance
    ratio of the shared-prompt update against the sampling-time log-probs is 1 up to round-off."""
    monkeypatch.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])
    cfg = GRPOStage(steps=2, batch_size=16, group_size=4, max_new_tokens=8, log_every=1, save_every=8, grad_accum=2,
                    loss="dapo", kl_coef=0.05, share_prompt=True, data=[{"world": "arithmetic", "n": 50}],
                    optim={"lr": 1e-3, "warmup_steps": 0, "min_lr_ratio": 1.0})
    ctx, sink = make_ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    priced = []  # the generate phase's cost counts each prompt's 4 samples (one prefill, shared keys)
    real_cost = NativeEngine.decode_cost
    monkeypatch.setattr(NativeEngine, "decode_cost", lambda self, **kw: priced.append(kw) or real_cost(self, **kw))
    run_grpo(cfg, ctx)
    assert len(priced) == 2 and all(kw["samples"] == 4 and kw["batch"] == 16 for kw in priced)
    recs = [r for r in sink.records if r["stage"] == "grpo"]
    assert len(recs) == 2
    assert recs[0]["clip/ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert recs[0]["kl"] == pytest.approx(0.0, abs=1e-4)  # step 1: the policy is still the reference


def test_activation_checkpointing_gives_the_same_training(tmp_path, policy_dir, tokenizer, world, monkeypatch):
    """`activation_checkpointing: true` recomputes each layer inside the backward — through the shared-prefix
    attention the forward ran (the switch spans the backward): the same rollouts, the same updates. Without
    that span the recomputation runs another kernel and torch's checkpoint raises (different saved tensors)."""
    monkeypatch.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])
    # the same layers both ways: under checkpointing the last layer runs whole (models/kept_columns.py), and its
    # weight gradients, summed over more rows, would differ in round-off, which AdamW's g/√v amplifies
    monkeypatch.setattr(kept_columns, "usable", lambda model: None)
    finals = {}
    for ckpt in (False, True):
        cfg = GRPOStage(steps=2, batch_size=16, group_size=4, max_new_tokens=8, log_every=1, save_every=8,
                        loss="dapo", share_prompt=True, activation_checkpointing=ckpt, data=[{"world": "arithmetic", "n": 50}],
                        optim={"lr": 1e-3, "warmup_steps": 0, "min_lr_ratio": 1.0})
        ctx, _ = make_ctx(tmp_path / str(ckpt), policy_dir, tokenizer, world, cfg)
        finals[ckpt] = load_model(run_grpo(cfg, ctx).checkpoint).state_dict()
    start = load_model(policy_dir).state_dict()
    moved = max(float((finals[False][k] - start[k]).abs().max()) for k in start)
    diff = max(float((finals[False][k] - finals[True][k]).abs().max()) for k in start)
    assert moved > 1e-4      # the two steps trained (lr 1e-3)
    assert diff < 1e-6       # recomputed activations are the same numbers: fp32 round-off at most
