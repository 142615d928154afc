"""The numeric guard in the shared optimizer step: a non-finite loss or gradient norm skips the step
(counted, the reason kept); N in a row stop the stage with the last good checkpoint kept. In SFT through
the pipeline, and in PPO, whose policy and critic take several guarded minibatch steps per iteration."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from conftest import make_ctx, make_reward_model, tiny_recipe_dict
from posttrain.pipeline.run import run_pipeline
from posttrain.runtime.checkpoint import verify_checkpoint
from posttrain.runtime.config import OptimConfig, PPOStage, Recipe
from posttrain.stages import ppo as ppo_module
from posttrain.stages import sft as sft_module
from posttrain.stages.ppo import run_ppo
from posttrain.stages._training import NonFiniteError, NumericGuard, Trainer, optimizer_step

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = OptimConfig(lr=0.1, warmup_steps=0, grad_clip=1.0)


def _trainer(said: list[str], limit: int = 3) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return Trainer(model, opt, sched, step=0, data_state=None, guard=NumericGuard(limit), name="sft", say=said.append)


def _step(t: Trainer, scale: float) -> float:
    loss = t.model(torch.ones(1, 4)).sum() * scale
    loss.backward()
    return optimizer_step(t, CFG, {"loss/sft": float(loss.detach())})


def _params(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


def test_a_nan_loss_skips_the_step_and_is_counted():
    said: list[str] = []
    t = _trainer(said)
    _step(t, 1.0)
    before, moments = _params(t), [s["exp_avg"].clone() for s in t.optimizer.state.values()]
    _step(t, float("nan"))                                            # step 2: NaN loss → NaN gradients
    assert all(torch.equal(a, b) for a, b in zip(before, _params(t)))  # parameters bitwise unchanged
    assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, t.optimizer.state.values()))
    assert [int(s["step"]) for s in t.optimizer.state.values()] == [1, 1]  # AdamW took one step, not two
    assert all(p.grad is None for p in t.model.parameters())          # the bad gradients are dropped
    assert t.step == 2 and t.scheduler.last_epoch == 2                # the count and the lr schedule move on
    assert t.guard.metrics() == {"train/skipped_steps": 1.0, "train/step_skipped": 1.0,
                                 "train/skip_reason": "loss/sft = nan at step 2"}
    assert said == ["[bold yellow]sft: optimizer step 2 skipped: loss/sft = nan at step 2 is not finite "
                    "(1 in a row, 1 in this stage; the stage stops at 3 in a row)"]
    _step(t, 1.0)                                                     # a good step resets the run of skips
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(t)))
    assert t.guard.metrics() == {"train/skipped_steps": 1.0, "train/step_skipped": 0.0}
    assert t.guard.in_a_row == 0 and t.guard.first is None


def test_an_infinite_gradient_with_a_finite_loss_is_named_as_the_gradient():
    t = _trainer([])
    t.model(torch.ones(1, 4)).sum().backward()
    t.model.weight.grad[0, 0] = float("inf")
    norm = optimizer_step(t, CFG, {"loss/sft": 1.0})
    assert norm == float("inf") and t.guard.reason == "gradient norm = inf at step 1"
    assert t.optimizer.state == {}  # never stepped


def test_n_skips_in_a_row_stop_with_the_first_cause():
    said: list[str] = []
    t = _trainer(said, limit=3)
    _step(t, 1.0)
    _step(t, float("nan"))
    _step(t, float("inf"))
    with pytest.raises(NonFiniteError) as e:
        _step(t, float("nan"))                                        # the third in a row
    assert str(e.value) == ("sft: stopped after 3 optimizer steps in a row with non-finite values; "
                            "first: loss/sft = nan at step 2; no checkpoint of this stage was written; "
                            "it restarts from its start on --resume")
    assert t.guard.skipped == 3


# ---- in a real stage: NaN forced into SFT's loss at chosen steps ------------------------------------


def _poison(monkeypatch, steps: set[int]) -> list[list[torch.Tensor]]:
    """Make SFT's training loss NaN at `steps` (grad_accum 1: the n-th training call is step n); returns
    the parameters seen at each training call."""
    real, seen = sft_module.sft_batch_loss, []

    def loss(model, encoded, pad_id, num_tokens):
        out, n = real(model, encoded, pad_id, num_tokens)
        if not model.training:  # the held-out eval
            return out, n
        seen.append([p.detach().clone() for p in model.parameters()])
        return (out * float("nan"), n) if len(seen) in steps else (out, n)

    monkeypatch.setattr(sft_module, "sft_batch_loss", loss)
    return seen


def _sft_only(**optim) -> Recipe:
    d = tiny_recipe_dict(threads=1, telemetry={"measure_cpu": False})
    d["stages"] = [d["stages"][1]]
    d["stages"][0]["optim"].update(optim)
    return Recipe.model_validate(d)


def test_a_forced_nan_at_step_5_is_skipped_and_counted(monkeypatch, tmp_path):
    seen = _poison(monkeypatch, {5})
    run_pipeline(_sft_only(), tmp_path / "run", console=Console(quiet=True))
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert [rows[s]["train/skipped_steps"] for s in range(1, 9)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert rows[5]["train/step_skipped"] == 1.0 and rows[5]["train/skip_reason"] == "loss/sft = nan at step 5"
    assert all(rows[s]["train/step_skipped"] == 0.0 and "train/skip_reason" not in rows[s] for s in (4, 6))
    assert all(torch.equal(a, b) for a, b in zip(seen[4], seen[5]))  # step 5 changed no parameter
    assert not all(torch.equal(a, b) for a, b in zip(seen[5], seen[6]))  # step 6 did
    assert verify_checkpoint(tmp_path / "run" / "checkpoints" / "sft" / "final") == []


def test_three_nans_in_a_row_stop_the_stage_and_keep_the_last_checkpoint(monkeypatch, tmp_path):
    _poison(monkeypatch, {4, 5, 6})
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError) as e:
        run_pipeline(_sft_only(max_nonfinite_skips=3), run, console=Console(quiet=True))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("sft: stopped after 3 optimizer steps in a row with non-finite values; "
                          "first: loss/sft = nan at step 4; ")
    assert msg.endswith("checkpoints/sft/step-000003 is the newest checkpoint kept")
    stage = run / "checkpoints" / "sft"
    assert sorted(p.name for p in stage.iterdir()) == ["step-000003"]
    assert verify_checkpoint(stage / "step-000003") == []


# ---- in PPO: the policy's and the critic's minibatch steps go through the same guard ----------------


def _ppo(tmp_path, policy_dir, tokenizer, world, steps: int, **optim):
    """A PPO stage of `steps` iterations, each 2 minibatch updates (8 rollouts, minibatches of 4, 1 epoch)
    of the policy and of the critic; a checkpoint after every iteration."""
    rm = make_reward_model(tmp_path / "rm", policy_dir)
    cfg = PPOStage(reward_model=str(rm), steps=steps, batch_size=8, minibatch_size=4, ppo_epochs=1, max_new_tokens=4,
                   data=[{"world": "arithmetic", "n": 16}], eval_per_level=0, log_every=1, save_every=1,
                   optim={"lr": 3e-3, "warmup_steps": 0, **optim})
    ctx, sink = make_ctx(tmp_path / "run", policy_dir, tokenizer, world, cfg)
    return cfg, ctx, sink


def _poison_ppo(monkeypatch, loss: str, calls: set[int]) -> list[tuple[str, list[torch.Tensor], list[torch.Tensor]]]:
    """Make PPO's `loss` (`ppo_clip_loss`: the policy's, `clipped_value_loss`: the critic's) NaN at its
    `calls`-th calls (one per minibatch update); returns, for every guarded update, the trainer's name and
    its model's parameters before and after it."""
    real_loss, real_update, seen = getattr(ppo_module, loss), ppo_module.guarded_update, []
    count = iter(range(1, 10_000))

    def poisoned(*args, **kwargs):
        out, stats = real_loss(*args, **kwargs)
        return (out * float("nan"), stats) if next(count) in calls else (out, stats)

    def update(t, *args, **kwargs):
        before = [p.detach().clone() for p in t.model.parameters()]
        try:
            return real_update(t, *args, **kwargs)
        finally:
            seen.append((t.name, before, [p.detach().clone() for p in t.model.parameters()]))

    monkeypatch.setattr(ppo_module, loss, poisoned)
    monkeypatch.setattr(ppo_module, "guarded_update", update)
    return seen


def _changed(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return not all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_nan_policy_loss_in_ppo_skips_that_update_only(monkeypatch, tmp_path, policy_dir, tokenizer, world):
    seen = _poison_ppo(monkeypatch, "ppo_clip_loss", {2})                 # iteration 1, its 2nd update
    cfg, ctx, sink = _ppo(tmp_path, policy_dir, tokenizer, world, steps=2)
    run_ppo(cfg, ctx)
    # updates in order: (policy, critic) × 2 per iteration → 8 guarded updates over 2 iterations
    assert [name for name, _, _ in seen] == ["ppo", "ppo critic"] * 4
    policy = [_changed(b, a) for name, b, a in seen if name == "ppo"]
    critic = [_changed(b, a) for name, b, a in seen if name == "ppo critic"]
    assert policy == [True, False, True, True]                          # the poisoned update left every weight as it was
    assert critic == [True, True, True, True]                           # the critic's own step was finite: taken
    rows = {r["step"]: r for r in sink.records if r["stage"] == "ppo"}
    assert rows[1]["train/skipped_steps"] == 1.0 and rows[1]["train/step_skipped"] == 1.0
    assert rows[1]["train/skip_reason"] == "loss/policy = nan at step 1 (update 2 of 2)"
    assert rows[1]["critic/skipped_steps"] == 0.0 and "critic/skip_reason" not in rows[1]
    assert rows[2]["train/skipped_steps"] == 1.0 and rows[2]["train/step_skipped"] == 0.0 and "train/skip_reason" not in rows[2]


@pytest.mark.parametrize(("loss", "who", "term"), [("ppo_clip_loss", "ppo", "loss/policy"),
                                                   ("clipped_value_loss", "ppo critic", "loss/value")])
def test_n_nans_in_a_row_in_ppo_stop_naming_the_term_and_step(monkeypatch, tmp_path, policy_dir, tokenizer, world,
                                                              loss, who, term):
    seen = _poison_ppo(monkeypatch, loss, set(range(2, 100)))            # from iteration 1's 2nd update on
    cfg, ctx, _ = _ppo(tmp_path, policy_dir, tokenizer, world, steps=3, max_nonfinite_skips=2)
    with pytest.raises(NonFiniteError) as e:
        run_ppo(cfg, ctx)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{who}: stopped after 2 optimizer steps in a row with non-finite values; "
                          f"first: {term} = nan at step 1 (update 2 of 2); ")
    assert msg.endswith("checkpoints/ppo/step-000001 is the newest checkpoint kept")  # saved after iteration 1
    assert verify_checkpoint(tmp_path / "run" / "checkpoints" / "ppo" / "step-000001") == []
    # its updates: iteration 1's first taken, its second skipped, iteration 2's first skipped → the stop
    assert [_changed(b, a) for name, b, a in seen if name == who] == [True, False, False]
