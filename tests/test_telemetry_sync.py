"""The `sync` phase: engines move the updated weights eagerly (`sync_weights` → bytes moved), the
stages time it apart from `generate`, and the memory consumers are recorded — on tiny GRPO and PPO runs."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.models import load_model
from posttrain.rollout import SamplingParams, make_engine
from posttrain.runtime.config import GRPOStage, PPOStage, Recipe
from posttrain.runtime.context import RunContext
from posttrain.rewards import WeightedVerifier
from posttrain.stages import grpo as grpo_mod
from posttrain.stages.ppo import run_ppo
from posttrain.telemetry import Telemetry, read_phases
from posttrain.telemetry.devices import Peaks
from conftest import ListSink, make_reward_model, world_tasks

pytestmark = pytest.mark.usefixtures("one_thread")
PEAKS = Peaks(name="synthetic", kind="cpu", flops={"fp32": 1e15}, bytes_per_s=1e15, source="test")


def test_native_sync_moves_the_weights_before_generate(policy_dir, tokenizer):
    model = load_model(policy_dir)
    engine = make_engine("native", model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompts = [[5, 6, 7], [8, 9]]
    engine.generate(prompts, params)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))   # an optimizer step, in effect
    moved = engine.sync_weights(model)
    w = engine.step.weights
    key = w._key
    # the rebuild reads q, k, v, gate, up (and the lm head) and writes their fused copies: at least twice
    # the bytes of those weights; o_proj and down_proj in fp32 are used in place (no copy)
    layers = model.model.layers
    qkv_gu = sum(m.weight.nbytes for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                               layer.self_attn.v_proj, layer.mlp.gate_proj, layer.mlp.up_proj))
    assert moved >= 2 * qkv_gu
    after = engine.generate(prompts, params)
    assert w._key == key                          # generate found the copies current: nothing hidden in it
    fresh = make_engine("native", model, tokenizer).generate(prompts, params)
    assert after.completion_ids.tolist() == fresh.completion_ids.tolist()   # and they are the updated weights


def _ctx(run_dir, start, tokenizer, world, stage) -> RunContext:
    torch.manual_seed(0)
    recipe = Recipe(stages=[stage], threads=1, evals=[{"task": "arithmetic", "levels": ["L2"], "max_new_tokens": 8}])
    tele = Telemetry.open(run_dir, peaks=PEAKS, busy=False)
    return RunContext(run_dir=run_dir, recipe=recipe, device=torch.device("cpu"), tokenizer=tokenizer, tasks=world_tasks(world),
                      telemetry=tele, sink=ListSink(), start=start)


def _digits(completions: list[str], **_) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def _check_sync(run_dir, stage: str, steps: list[int]) -> None:
    recs = read_phases(run_dir / "phases.jsonl")
    sync = [r for r in recs if r.name == "sync"]
    assert [r.step for r in sync] == steps
    assert all(r.bytes > 0 and r.seconds > 0 and r.flops == 0 for r in sync)
    assert all(r.mem_peak is not None for r in recs)   # memory on every phase
    names = {r.name for r in recs if r.stage == stage}
    assert {"generate", "score", "reference", "update", "sync"} <= names
    consumers = json.loads((run_dir / "memory.jsonl").read_text().splitlines()[0])["consumers"]
    assert {"weights", "optimizer state", "reference copy", "engine fused weights", "engine KV cache"} <= set(consumers)


def test_grpo_times_sync_with_bytes(tmp_path, policy_dir, tokenizer, world, monkeypatch):
    monkeypatch.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])
    cfg = GRPOStage(steps=2, batch_size=8, group_size=4, max_new_tokens=6, log_every=1, save_every=2, loss="dapo",
                    kl_coef=0.05, data=[{"task": "arithmetic", "n": 50}], eval_every=0,
                    optim={"lr": 1e-3, "warmup_steps": 0, "min_lr_ratio": 1.0})
    ctx = _ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    grpo_mod.run_grpo(cfg, ctx)
    ctx.telemetry.close()
    _check_sync(tmp_path, "grpo", [1, 2])


def test_ppo_times_sync_with_bytes(tmp_path, policy_dir, tokenizer, world):
    rm_dir = make_reward_model(tmp_path / "rm", policy_dir)
    cfg = PPOStage(reward_model=str(rm_dir), steps=2, batch_size=8, minibatch_size=8, ppo_epochs=1, max_new_tokens=4,
                   data=[{"task": "arithmetic", "n": 32}], missing_eos_score=None, kl_coef=0.01, eval_per_level=1,
                   eval_samples=1, log_every=1, optim={"lr": 1e-3, "warmup_steps": 0, "min_lr_ratio": 1.0})
    ctx = _ctx(tmp_path / "run", policy_dir, tokenizer, world, cfg)
    run_ppo(cfg, ctx)
    ctx.telemetry.close()
    _check_sync(tmp_path / "run", "ppo", [1, 2])
