"""Rollout workers as Ray actors (posttrain/distributed/ray_engine.py, docs/placement.md), on a local
2-CPU cluster started once for the module: the samples equal the in-process engine's (1 and 2 workers),
a delta sync leaves a worker bit-equal to a full one and moves fewer bytes, a killed worker (between two
calls, and in the middle of one) is restarted and its request re-issued with the same samples, past the
restart budget the run stops with a message naming the worker, and the workers' phases reach phases.jsonl.

Each actor start costs a few seconds (a Python process importing torch and transformers, then building
the model); the module starts about ten.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from posttrain.distributed.ray_engine import (  # noqa: E402
    Placement,
    PlacementError,
    RayRolloutEngine,
    RolloutWorker,
    concat_rollouts,
    shard_params,
    split_prompts,
)
from posttrain.rollout import SamplingParams, make_engine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "cluster")

PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=11)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # the slow worker below travels by value: the actor processes cannot import this test module
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


@pytest.fixture()
def model(tok):
    from posttrain.models import build_tiny

    return build_tiny("tiny-1m", vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(f"{a} + 3 =") for a in (1, 22, 7, 15, 408)]  # 5 prompts: shares of 3 and 2 over 2 workers


def same_samples(a, b) -> None:
    assert a.texts == b.texts
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.prompt_ids, b.prompt_ids)
    assert torch.equal(a.prompt_index, b.prompt_index) and a.finish_reason == b.finish_reason
    # the same tokens from the same weights; a share is another batch shape, so sums may run in another order
    assert torch.allclose(a.policy_logprobs, b.policy_logprobs, atol=1e-5)


def test_shares_and_shards_by_hand():
    assert split_prompts(5, 2) == [range(0, 3), range(3, 5)]
    assert split_prompts(1, 3) == [range(0, 1)]  # a worker with nothing to do gets no call
    p = SamplingParams(n=2, seed=1)
    assert shard_params(p, range(0, 5), 5) is p                       # the whole batch: unchanged
    assert shard_params(p, range(3, 5), 5).shard == (6, 10)           # prompts 3–4 are rows 6–9 of 10
    # a data-parallel rank's share (rows 10–19 of 40) split again: its prompts 3–4 are rows 16–19 of 40
    assert shard_params(SamplingParams(n=2, seed=1, shard=(10, 40)), range(3, 5), 5).shard == (16, 40)


@pytest.mark.slow
def test_samples_equal_the_in_process_engine_with_one_and_two_workers(model, tok, prompts):
    reference = make_engine("native", model, tok).generate(prompts, PARAMS)
    for workers in (1, 2):
        engine = RayRolloutEngine(model, tok, placement=Placement(rollout_workers=workers, num_cpus_per_worker=1))
        try:
            got = engine.generate(prompts, PARAMS)
        finally:
            engine.close()
        same_samples(got, reference)
    # and the gather itself: two parts of the in-process rollout put back together are the whole
    first, second = (make_engine("native", model, tok).generate(prompts[s], shard_params(PARAMS, r, 5))
                     for s, r in ((slice(0, 3), range(0, 3)), (slice(3, 5), range(3, 5))))
    same_samples(concat_rollouts([first, second], [0, 3], tok.pad_token_id), reference)


def adamw_steps(model, steps: int, lr: float) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(0, 40, (4, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.slow
def test_a_delta_synced_worker_equals_a_fully_synced_one_bitwise(model, tok, prompts):
    # bf16 sampling: the weights travel in bf16, and at lr 1e-4 many roundings do not move
    opts = {"dtype": torch.bfloat16}
    delta = RayRolloutEngine(model, tok, placement=Placement(sync="delta", num_cpus_per_worker=1), options=opts)
    full = RayRolloutEngine(model, tok, placement=Placement(sync="full", mode="colocated"), options=opts)
    try:
        sent = {"delta": 0, "full": 0}
        for _ in range(3):
            adamw_steps(model, 1, 1e-4)
            sent["delta"] += delta.sync_weights(model)
            sent["full"] += full.sync_weights(model)
        got_delta = ray.get(delta.workers()[0].digest.remote())
        got_full = ray.get(full.workers()[0].digest.remote())
        assert got_delta == got_full  # every tensor's fingerprint: the same bytes
        m = delta.take_metrics()
        assert m["sync/bytes"] == sent["delta"] and m["sync/bytes_full"] == sent["full"]
        print(f"\n3 syncs after AdamW steps at lr 1e-4, tiny-1m in bf16: delta {sent['delta']:,} bytes, full {sent['full']:,}")
        assert sent["delta"] < sent["full"]
        same_samples(delta.generate(prompts, PARAMS), full.generate(prompts, PARAMS))
    finally:
        delta.close()
        full.close()


@pytest.mark.slow
def test_a_worker_killed_between_two_calls_is_restarted_with_the_same_samples(model, tok, prompts):
    engine = RayRolloutEngine(model, tok, placement=Placement(max_restarts=1, num_cpus_per_worker=1))
    try:
        before = engine.generate(prompts, PARAMS)
        adamw_steps(model, 1, 1e-3)
        engine.sync_weights(model)  # the restart must bring these weights, not the start's
        after = engine.generate(prompts, PARAMS)
        ray.kill(engine.workers()[0])
        again = engine.generate(prompts, PARAMS)
        same_samples(again, after)
        assert again.texts != before.texts  # the restarted worker samples the synced weights
        assert engine.take_metrics()["placement/worker_restarts"] == 1
        ray.kill(engine.workers()[0])  # its one restart is spent: the next death stops the run
        with pytest.raises(PlacementError, match=r"rollout worker rollout0 died and has used its 1 restarts .*Cause: .*Actor"):
            engine.generate(prompts, PARAMS)
    finally:
        engine.close()


class SlowWorker(RolloutWorker):
    """A worker whose generate says it has started (a file) and then takes a while: a kill lands mid-call."""

    marker = ""

    def generate(self, prompts, params):
        Path(self.marker).write_text("generating")
        time.sleep(2.0)
        return super().generate(prompts, params)


@pytest.mark.slow
def test_a_worker_killed_in_the_middle_of_a_call_is_restarted_and_the_call_reissued(model, tok, prompts, tmp_path):
    reference = make_engine("native", model, tok).generate(prompts, PARAMS)
    SlowWorker.marker = str(tmp_path / "started")
    engine = RayRolloutEngine(model, tok, placement=Placement(num_cpus_per_worker=1), worker_cls=SlowWorker)
    victim = engine.workers()[0]

    def kill_when_started() -> None:
        while not Path(SlowWorker.marker).exists():
            time.sleep(0.05)
        ray.kill(victim)

    killer = threading.Thread(target=kill_when_started)
    killer.start()
    try:
        got = engine.generate(prompts, PARAMS)  # the first call dies inside generate; the re-issued one answers
        killer.join(timeout=60)
        same_samples(got, reference)
        assert engine.restarts == 1 and engine.workers()[0] is not victim
    finally:
        engine.close()


def test_workers_phases_land_in_phases_jsonl_on_the_run_clock(model, tok, prompts, tmp_path):
    from posttrain.telemetry import Telemetry

    tele = Telemetry.open(tmp_path, busy=False, memory=False, peak_flops=1e12, peak_bytes_per_s=1e10)
    engine = RayRolloutEngine(model, tok, placement=Placement(mode="colocated", sync="delta"))
    engine.attach(tele)
    try:
        with tele.phase("generate", stage="grpo", step=1):
            engine.generate(prompts, PARAMS)
        with tele.phase("sync", stage="grpo", step=1):
            engine.sync_weights(model)
        engine.generate(prompts, PARAMS)  # outside any phase (an eval): not recorded
    finally:
        engine.close()
        tele.close()
    records = [json.loads(line) for line in (tmp_path / "phases.jsonl").read_text().splitlines()]
    main = {r["name"]: r for r in records if "worker" not in r}
    workers = {r["name"]: r for r in records if r.get("worker") == "rollout0"}
    assert set(main) == set(workers) == {"generate", "sync"} and len(records) == 4
    for name in ("generate", "sync"):
        outer, inner = main[name], workers[name]
        assert inner["stage"] == "grpo" and inner["step"] == 1
        # the worker's phase lies inside the driver's (clocks mapped; 50 ms for the offset's estimate)
        assert outer["start"] - 0.05 <= inner["start"] and inner["start"] + inner["seconds"] <= outer["start"] + outer["seconds"] + 0.05
    assert workers["generate"]["flops"] > 0 and workers["sync"]["bytes"] == 0  # nothing changed since the start


def test_the_recipe_block_is_typed_and_checked():
    from posttrain.runtime.config import Recipe

    stage = {"stage": "grpo", "data": [{"task": "arithmetic", "n": 8}], "batch_size": 8, "group_size": 4}
    assert Recipe.model_validate({"stages": [stage]}).placement is None  # absent: one process
    r = Recipe.model_validate({"stages": [stage], "placement": {"rollout_workers": 2, "sync": "delta"}})
    assert Placement(**r.placement.model_dump()) == Placement(rollout_workers=2, sync="delta")
    assert Placement(mode="colocated").cpus == 0 and Placement(num_cpus_per_worker=2).cpus == 2
    with pytest.raises(ValueError, match="placement.workers"):
        Recipe.model_validate({"stages": [stage], "placement": {"workers": 2}})  # unknown key, named
    with pytest.raises(ValueError, match="placement.sync"):
        Recipe.model_validate({"stages": [stage], "placement": {"sync": "bytes"}})


def test_a_cluster_too_small_for_the_workers_is_refused_before_any_starts(model, tok):
    # the module's cluster has 2 CPUs: 3 workers × 1 CPU cannot be placed (they would wait forever)
    with pytest.raises(PlacementError, match=r"3 rollout workers × 1 CPUs need 3 CPUs; the Ray cluster has 2"):
        RayRolloutEngine(model, tok, placement=Placement(rollout_workers=3))


def test_a_silent_worker_is_taken_for_dead_at_the_timeout(model, tok, prompts, tmp_path):
    # the slow worker sleeps 2 s in every generate; a 0.5 s timeout with no restarts left stops the run
    SlowWorker.marker = str(tmp_path / "started")
    engine = RayRolloutEngine(model, tok, placement=Placement(timeout_s=0.5, max_restarts=0, num_cpus_per_worker=1),
                              worker_cls=SlowWorker)
    try:
        with pytest.raises(PlacementError, match=r"rollout0 timed out and has used its 0 restarts .*GetTimeoutError"):
            engine.generate(prompts, PARAMS)
    finally:
        engine.close()


def test_a_lora_policy_is_rebuilt_in_the_worker_with_its_adapters(model, tok, prompts):
    from posttrain.models import lora

    policy = lora.wrap(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    with torch.no_grad():  # B starts at 0 (the adapted model is the base model): give the adapters an effect
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    reference = make_engine("native", policy, tok).generate(prompts, PARAMS)
    plain = make_engine("native", model, tok)
    with lora.adapters_disabled(policy):
        base = plain.generate(prompts, PARAMS)
    assert base.texts != reference.texts  # the adapters change the samples: the comparison below can fail
    engine = RayRolloutEngine(policy, tok, placement=Placement(mode="colocated", sync="delta"))
    try:
        same_samples(engine.generate(prompts, PARAMS), reference)
    finally:
        engine.close()
