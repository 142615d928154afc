"""A short GRPO stage with its rollouts on a Ray actor (`placement: {mode: split, rollout_workers: 1}`)
against the same stage in one process: the same samples, so the same final weights (within fp32
round-off; the max difference is printed), the sync metrics in metrics.jsonl, and the worker's phases in
phases.jsonl beside the learner's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from conftest import ListSink, world_tasks  # noqa: E402
from posttrain.rewards import WeightedVerifier  # noqa: E402
from posttrain.runtime.config import GRPOStage, Recipe  # noqa: E402
from posttrain.runtime.context import RunContext  # noqa: E402
from posttrain.stages import grpo as grpo_mod  # noqa: E402
from posttrain.telemetry import Telemetry  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _length(completions: list[str], **_) -> list[float]:
    """A reward that differs inside every group even for a random model: every step updates the weights."""
    return [len(c) / 10 for c in completions]


def stage() -> GRPOStage:
    return GRPOStage(steps=3, batch_size=8, group_size=4, max_new_tokens=8, log_every=1, save_every=8, kl_coef=0.05,
                     data=[{"world": "arithmetic", "n": 40}], optim={"lr": 1e-2, "warmup_steps": 0})


def run(tmp_path, policy_dir, tokenizer, world, placement: dict | None):
    torch.manual_seed(0)
    cfg = stage()
    recipe = Recipe(stages=[cfg], threads=1, placement=placement)
    tele = Telemetry.open(tmp_path, busy=False, memory=False, peak_flops=1e12, peak_bytes_per_s=1e10)
    sink = ListSink()
    ctx = RunContext(run_dir=tmp_path, recipe=recipe, device=torch.device("cpu"), tokenizer=tokenizer,
                     tasks=world_tasks(world), telemetry=tele, sink=sink, start=policy_dir)
    try:
        result = grpo_mod.run_grpo(cfg, ctx)
    finally:
        tele.close()
    return load_file(result.checkpoint / "model.safetensors"), sink.records


@pytest.mark.slow
def test_grpo_with_a_ray_rollout_worker_equals_the_in_process_run(tmp_path, policy_dir, tokenizer, world, monkeypatch):
    monkeypatch.setattr(grpo_mod, "build_rewards", lambda specs: [WeightedVerifier("length", _length)])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        here, here_rows = run(tmp_path / "here", policy_dir, tokenizer, world, None)
        placed, placed_rows = run(tmp_path / "placed", policy_dir, tokenizer, world,
                                  {"mode": "split", "rollout_workers": 1, "sync": "delta"})
    finally:
        ray.shutdown()
    start = load_file(policy_dir / "model.safetensors")
    diff = max(float((here[k] - placed[k]).abs().max()) for k in here)
    moved = max(float((here[k] - start[k]).abs().max()) for k in here)
    print(f"\nGRPO, 3 steps: max |w(Ray worker) − w(in process)| = {diff:.3g} (training moved weights by up to {moved:.3g})")
    assert moved > 1e-3 and diff <= 1e-6
    # the same samples: the same rewards at every step
    assert [r["reward/length"] for r in placed_rows] == [r["reward/length"] for r in here_rows]
    for r in placed_rows:
        # fp32 full fine-tuning: AdamW moves every tensor, so a delta is every tensor (3,439,104 bytes for tiny-1m)
        assert r["sync/bytes"] == r["sync/bytes_full"] > 0 and r["sync/seconds"] > 0
        assert r["placement/worker_restarts"] == 0
    assert not any("sync/bytes" in r for r in here_rows)
    phases = [json.loads(line) for line in (tmp_path / "placed" / "phases.jsonl").read_text().splitlines()]
    lanes = {(p.get("worker", "main"), p["name"]) for p in phases}
    assert {("rollout0", "generate"), ("rollout0", "sync"), ("main", "generate"), ("main", "update"), ("main", "sync")} <= lanes
    assert sorted(p["step"] for p in phases if p.get("worker") == "rollout0" and p["name"] == "generate") == [1, 2, 3]
