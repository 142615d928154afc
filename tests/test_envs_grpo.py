"""GRPO over multi-turn episodes on a tiny model: it runs, learns what its reward asks, changes every
parameter, logs the episode metrics, times `tool` on the split bar, and the config checks its options."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from posttrain.data.records import Message
from posttrain.envs import EnvironmentFactory, StepResult
from posttrain.rewards import WeightedVerifier
from posttrain.runtime.config import GRPOStage, Recipe
from posttrain.runtime.context import RunContext
from posttrain.stages import _episodes as episodes_mod
from posttrain.stages import grpo as grpo_mod
from posttrain.telemetry import Telemetry, read_phases
from posttrain.telemetry.devices import Peaks
from conftest import ListSink, killed_after_save, world_tasks

pytestmark = pytest.mark.usefixtures("one_thread")
PEAKS = Peaks(name="synthetic", kind="cpu", flops={"fp32": 1e15}, bytes_per_s=1e15, source="test")


def _digits(completions: list[str], **_) -> list[float]:
    """A reward a random tiny model can learn in a few steps: the share of the final turn's characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


class TwoTurns:
    """Every episode: the model's first turn is answered by a tool message; its second turn ends the episode."""

    def __init__(self):
        self.k = 0

    def reset(self, problem):
        return [Message("user", problem.prompt)]

    def step(self, text):
        self.k += 1
        if self.k == 1:
            return StepResult([Message("tool", "12 + 30 = 42")], None, done=False, tool_calls=1)
        return StepResult([], None, done=True)


def _ctx(run_dir, start, tokenizer, world, stage):
    torch.manual_seed(0)
    recipe = Recipe(stages=[stage], threads=1, evals=[{"task": "arithmetic", "levels": ["L2"], "max_new_tokens": 8}])
    sink = ListSink()
    return RunContext(run_dir=run_dir, recipe=recipe, device=torch.device("cpu"), tokenizer=tokenizer,
                      tasks=world_tasks(world), telemetry=Telemetry.open(run_dir, peaks=PEAKS, busy=False),
                      sink=sink, start=start), sink


def _cfg(**over):
    kw = dict(steps=8, batch_size=16, group_size=4, max_new_tokens=8, log_every=1, save_every=8, loss="dapo",
              kl_coef=0.05, eval_every=0, data=[{"world": "arithmetic", "n": 200}],
              optim={"lr": 2e-2, "warmup_steps": 0, "min_lr_ratio": 1.0},
              env={"name": "tools", "max_turns": 3, "max_tokens": 120})
    kw.update(over)
    return GRPOStage(**kw)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, policy_dir, tokenizer, world):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])
        mp.setattr(grpo_mod, "build_env", lambda *_: EnvironmentFactory(TwoTurns))
        run_dir = tmp_path_factory.mktemp("grpo_episodes")
        ctx, sink = _ctx(run_dir, policy_dir, tokenizer, world, _cfg())
        result = grpo_mod.run_grpo(_cfg(), ctx)
        ctx.telemetry.close()
        return result, sink, run_dir


def test_episode_grpo_learns_and_changes_every_parameter(smoke, policy_dir):
    result, sink, _ = smoke
    recs = [r for r in sink.records if r["stage"] == "grpo"]
    assert [r["step"] for r in recs] == list(range(1, 9))
    first = sum(r["reward/digits"] for r in recs[:3]) / 3
    last = sum(r["reward/digits"] for r in recs[-3:]) / 3
    assert last > first + 0.1, (first, last)  # the final turns hold more digits
    for r in recs:
        assert r["episode/turns_mean"] == 2.0 and r["episode/tool_calls_mean"] == 1.0   # every episode: 2 turns, 1 call
        assert r["episode/tool_use_frac"] == 1.0 and r["episode/tool_errors"] == 0.0
        assert r["episode/end_turn_budget_frac"] == 0.0 and r["episode/tokens_mean"] <= 120
        assert r.get("reward/tool_share", 1.0) == 1.0  # every episode used the tool: all the reward is theirs
        # turn 2 starts from the KV cache turn 1 kept (env.keep_kv, on by default): its prefill is saved, turn 1's is not
        assert 0 < r["episode/prefill_tokens_saved"] < r["episode/prompt_tokens"]
    for key in ("kl", "entropy", "clip/low", "train/grad_norm", "response/length_mean", "reward/pass_rate",
                "groups/zero_variance_frac", "episode/env_seconds"):
        assert all(math.isfinite(r[key]) for r in recs), key
    before = load_file(policy_dir / "model.safetensors")
    after = load_file(result.checkpoint / "model.safetensors")
    assert not [k for k in before if torch.equal(before[k], after[k])]


def test_episode_grpo_times_tool_as_its_own_phase(smoke):
    _, _, run_dir = smoke
    recs = [r for r in read_phases(run_dir / "phases.jsonl") if r.stage == "grpo"]
    names = {r.name for r in recs}
    assert {"generate", "tool", "score", "update", "sync"} <= names
    generate = [r for r in recs if r.name == "generate" and r.step == 1]
    assert len(generate) == 2 and all(r.flops > 0 for r in generate)   # two turns → two generate calls per step
    assert sum(r.name == "tool" for r in recs if r.step == 1) == 2      # and two waits on the environment


def test_the_update_sees_the_model_tokens_only(policy_dir, tokenizer, world, tmp_path, monkeypatch):
    """With μ = 1 the importance ratio over the episode mask is 1: the update's log-probs on the model's
    tokens are the sampling-time ones (a mask landing on environment tokens would read log-probs of 0)."""
    monkeypatch.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])
    monkeypatch.setattr(grpo_mod, "build_env", lambda *_: EnvironmentFactory(TwoTurns))
    for share in (False, True):
        cfg = _cfg(steps=1, save_every=1, grad_accum=2, share_prompt=share, optim={"lr": 1e-3, "warmup_steps": 0})
        ctx, sink = _ctx(tmp_path / str(share), policy_dir, tokenizer, world, cfg)
        grpo_mod.run_grpo(cfg, ctx)
        ctx.telemetry.close()
        (rec,) = [r for r in sink.records if r["stage"] == "grpo"]
        assert rec["clip/ratio_max"] == pytest.approx(1.0, abs=1e-3) and rec["kl"] == pytest.approx(0.0, abs=1e-4)
        assert rec["clip/approx_kl"] == pytest.approx(0.0, abs=1e-5) and rec["clip/low"] == rec["clip/high"] == 0.0


def test_resume_after_kill_is_exact(policy_dir, tokenizer, world, tmp_path, monkeypatch):
    """Episodes in lockstep are reproducible (seeded per step and per generate call): a run killed after
    its step-2 checkpoint and resumed ends with the same weights as the run that was never stopped."""
    monkeypatch.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])
    monkeypatch.setattr(grpo_mod, "build_env", lambda *_: EnvironmentFactory(TwoTurns))

    def cfg():
        return _cfg(steps=4, save_every=2, batch_size=8, mu=2, kl_coef=0.0, optim={"lr": 1e-2, "warmup_steps": 0},
                    data=[{"world": "arithmetic", "n": 40}])

    ctx, _ = _ctx(tmp_path / "straight", policy_dir, tokenizer, world, cfg())
    straight = grpo_mod.run_grpo(cfg(), ctx).checkpoint

    ctx, _ = _ctx(tmp_path / "killed", policy_dir, tokenizer, world, cfg())
    with killed_after_save(monkeypatch, grpo_mod):  # killed right after the step-2 checkpoint
        grpo_mod.run_grpo(cfg(), ctx)
    ctx, _ = _ctx(tmp_path / "killed", policy_dir, tokenizer, world, cfg())
    torch.manual_seed(123)  # the resumed run must not depend on the global RNG it finds
    resumed = grpo_mod.run_grpo(cfg(), ctx).checkpoint
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_built_in_tool_env_runs_in_the_stage(policy_dir, tokenizer, world, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("digits", _digits)])
    # the tools' system prompt is ~280 tokens of the tiny byte-level vocabulary: left out here (the model's context is 160)
    cfg = _cfg(steps=1, save_every=1, batch_size=8, env={"name": "tools", "max_turns": 2, "max_tokens": 150,
                                                          "params": {"tools": ["calculator"], "system_prompt": False}})
    ctx, sink = _ctx(tmp_path, policy_dir, tokenizer, world, cfg)
    grpo_mod.run_grpo(cfg, ctx)
    ctx.telemetry.close()
    (rec,) = [r for r in sink.records if r["stage"] == "grpo"]
    assert 1.0 <= rec["episode/turns_mean"] <= 2.0 and math.isfinite(rec["loss/policy"])


def test_config_checks_the_env_options():
    with pytest.raises(ValueError, match="dynamic_sampling is not supported with env"):
        _cfg(dynamic_sampling=True)
    with pytest.raises(ValueError, match="name"):
        _cfg(env={"name": "chess"})
    with pytest.raises(ValueError, match="extra|not permitted"):
        _cfg(env={"name": "tools", "turns": 3})
    cfg = _cfg(env={"name": "tools", "params": {"tools": ["calculator"]}})
    assert episodes_mod.build_env(None, cfg.env, cfg.data).tools  # a registered environment needs no context
