"""The learner as a torch.distributed group inside Ray actors (posttrain/distributed/ray_learners.py,
`posttrain run --nproc N --launcher ray`, docs/placement.md "The learner in Ray actors").

- by hand: local ranks, the environment a rank gets, the refusal of rollout workers beside N > 1 ranks;
- on a local cluster (`ray.init(num_cpus=3)`, once for the module) with small entries instead of a run:
  2 actors form a gloo group (an all-reduce of the ranks: 0 + 1 = 1), rank 0's output reaches the
  driver; a rank that raises, or is `ray.kill`ed while its peer waits in a collective, ends the launch
  with an error naming the rank and the cause — no hang: the peer would wait 600 s
  (POSTTRAIN_DIST_TIMEOUT_S) and the launch must end long before;
- whole runs (slow): SFT through `posttrain run --nproc 2 --launcher ray` bitwise equal to torchrun's
  2 ranks; a real SFT run whose rank 1 is killed after its first logged step.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")

from posttrain.distributed.ray_learners import (  # noqa: E402
    LearnerError,
    LearnerGroup,
    check_rollout_placement,
    env_for,
    launch_learners,
    local_ranks,
)

from test_distributed import _run, max_diff, run_one, run_ranks, sft_recipe, weights  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HANG_S = 600  # a rank left in a collective waits this long (POSTTRAIN_DIST_TIMEOUT_S in the tests below)
BOUND_S = 120  # the launch must end well before: seconds a failure may take to stop every rank (load included)

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- by hand ---------------------------------------------------------------------------------------------
def test_local_ranks_and_the_environment_of_a_rank():
    assert local_ranks(["a", "b", "a", "a"]) == [0, 0, 1, 2]  # the 2nd rank on node a is its local rank 1
    assert env_for(1, 2, 0, 1, "10.0.0.5", 29511) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                                      "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29511"}
    with pytest.raises(ValueError, match="expected nproc ≥ 1"):
        LearnerGroup(0)


def test_rollout_workers_beside_several_learner_ranks_are_refused_by_stage():
    stages = [("sft", "sft"), ("grpo", "rl")]
    check_rollout_placement(1, 2, stages)        # one learner rank: it builds the Ray rollout engine as one process
    check_rollout_placement(2, None, stages)     # no placement block: each rank samples in itself
    check_rollout_placement(2, 1, [("sft", "sft"), ("dpo", "dpo")])  # nothing samples
    with pytest.raises(LearnerError, match=r"stages\[1\] \(rl\): placement.rollout_workers with --launcher ray --nproc 2 is not supported"):
        check_rollout_placement(2, 1, stages)


def test_the_cli_refuses_it_before_starting_anything(tmp_path):
    d = sft_recipe()
    d["placement"] = {"rollout_workers": 1}
    d["stages"].append({"stage": "grpo", "steps": 1, "batch_size": 8, "group_size": 4, "data": [{"task": "arithmetic", "n": 16}],
                        "rewards": [{"name": "math"}]})
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(d))
    r = _run([sys.executable, "-m", "posttrain.cli", "run", str(recipe), "--out", str(tmp_path / "run"), "--nproc", "2",
              "--launcher", "ray"])
    assert r.returncode == 2, r.stdout[-2000:]
    assert "stages[1] (grpo): placement.rollout_workers with --launcher ray --nproc 2 is not supported" in " ".join(r.stdout.split())
    assert "launching" not in r.stdout and not (tmp_path / "run").exists()


# ---- the mechanism, with small entries --------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the entries below travel by value
    yield
    ray.shutdown()


@pytest.fixture()
def patient(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_DIST_TIMEOUT_S", str(HANG_S))  # forwarded to the ranks by launch_learners


def _join_group() -> int:
    from posttrain.distributed import init_world

    world = init_world("cpu")
    assert world.world_size == 2 and world.backend == "gloo"
    return world.rank


def entry_sum(argv: list[str]) -> int:
    from posttrain.distributed import init_world

    world = init_world("cpu")
    assert world.world_size == 2 and world.backend == "gloo"
    summed = world.sum({"rank": float(world.rank)})  # a collective over the two actors
    if world.is_main:
        print(f"{argv[0]}: sum of ranks {summed['rank']:g}, LOCAL_RANK {os.environ['LOCAL_RANK']}")
    world.close()
    return 0


def entry_raise_on_1(argv: list[str]) -> int:
    import torch.distributed as tdist

    rank = _join_group()
    if rank == 1:
        raise ValueError("boom on rank 1")
    tdist.barrier()  # rank 0 waits for rank 1, which will never come (HANG_S)
    return 0


def entry_wait(argv: list[str]) -> int:
    import torch.distributed as tdist

    if _join_group() == 1:
        print("ready", flush=True)
        time.sleep(HANG_S)  # rank 1 is busy (killed here) …
    tdist.barrier()  # … while rank 0 waits for it in a collective (HANG_S)
    return 0


def entry_exit_2(argv: list[str]) -> int:
    return 2 if os.environ["RANK"] == "1" else 0


@pytest.mark.usefixtures("cluster", "patient")
def test_two_actors_form_a_group_and_rank_0_speaks():
    said: list[str] = []
    assert launch_learners(LearnerGroup(2), entry_sum, ["hello"], print_fn=said.append) == 0
    assert "".join(said).strip() == "hello: sum of ranks 1, LOCAL_RANK 0"  # 0 + 1; rank 0 is the first on its node


@pytest.mark.usefixtures("cluster", "patient")
def test_a_rank_that_raises_stops_the_other_with_its_cause():
    t0 = time.monotonic()
    with pytest.raises(LearnerError) as e:
        launch_learners(LearnerGroup(2), entry_raise_on_1, [], print_fn=lambda s: None)
    assert time.monotonic() - t0 < BOUND_S, "the launch waited for the collective's timeout"
    text = str(e.value)
    assert text.startswith("learner rank 1 failed: ValueError: boom on rank 1; stopped the other ranks (0)")
    assert "rank 1's output" in text and "Traceback" in text  # the tail of rank 1's output, its traceback


@pytest.mark.usefixtures("cluster", "patient")
def test_a_rank_that_exits_non_zero_stops_the_run():
    with pytest.raises(LearnerError, match=r"^learner rank 1 exited with status 2"):
        launch_learners(LearnerGroup(2), entry_exit_2, [], print_fn=lambda s: None)


def _kill_rank_1_when(ready) -> tuple[list, threading.Thread]:
    """An `on_started` that kills rank 1's actor from another thread once `ready(actors)` is true."""
    killed: list = []

    def watch(actors):
        deadline = time.monotonic() + BOUND_S
        while not ready(actors) and time.monotonic() < deadline:
            time.sleep(0.2)
        ray.kill(actors[1], no_restart=True)
        killed.append((actors, time.monotonic()))

    def on_started(actors):
        threading.Thread(target=watch, args=(actors,), daemon=True).start()

    return killed, on_started


@pytest.mark.usefixtures("cluster", "patient")
def test_a_rank_killed_in_a_collective_stops_the_run_with_a_clear_message():
    killed, on_started = _kill_rank_1_when(lambda actors: "ready" in ray.get(actors[1].output.remote()))
    t0 = time.monotonic()
    with pytest.raises(LearnerError) as e:
        launch_learners(LearnerGroup(2), entry_wait, [], print_fn=lambda s: None, on_started=on_started)
    assert time.monotonic() - t0 < BOUND_S, "the launch waited for the collective's timeout"
    assert killed, "the watcher never killed rank 1"
    assert str(e.value).startswith("learner rank 1 failed: ActorDiedError"), str(e.value)
    assert "stopped the other ranks (0)" in str(e.value)
    # rank 0 was stopped, not left in its barrier (HANG_S): `ray.kill` is asynchronous, and a call that
    # reaches the actor first is still answered, so ask until it is gone (on a loaded machine, seconds)
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(killed[0][0][0].output.remote(), timeout=60)
            time.sleep(0.5)


# ---- whole runs ----------------------------------------------------------------------------------------
def _sft(tmp: Path, **stage) -> Path:
    d = sft_recipe()
    d["stages"][0].update({"steps": 3, "save_every": 100, **stage})
    path = tmp / "sft.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.mark.heavy  # 26 s; the Ray learners are in the default run through the learner-and-rollout-worker test below
def test_sft_through_the_ray_launcher_equals_torchrun_bitwise(tmp_path):
    """The same recipe (8 sequences in 4 micro-batches: each rank 2, summed) through `--launcher ray` and
    torchrun: the same processes' computation, so the same bits (38 of 38 tensors)."""
    recipe = _sft(tmp_path)
    said = run_one(recipe, tmp_path / "ray", "--nproc", "2", "--launcher", "ray")
    assert "launching 2 learner ranks as Ray actors" in said and "on 2 ranks (gloo)" in said  # rank 0's lines, here
    assert "(2 ranks × 2 of 2 sequences)" in said
    run_ranks(2, recipe, tmp_path / "torchrun")
    a, b = weights(tmp_path / "ray", "sft"), weights(tmp_path / "torchrun", "sft")
    moved = max_diff(a, weights(tmp_path / "ray", "base"))
    print(f"\n--launcher ray vs torchrun, SFT 3 steps: max |Δw| = {max_diff(a, b):.3g} (training moved weights by up to {moved:.3g})")
    assert moved > 1e-3
    assert all(bool((a[k] == b[k]).all()) for k in a)


@pytest.mark.slow
@pytest.mark.usefixtures("cluster", "patient")
def test_a_rank_killed_mid_run_stops_the_run(tmp_path):
    from posttrain.cli import _rank_entry

    recipe = _sft(tmp_path, steps=40, log_every=1)
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    killed, on_started = _kill_rank_1_when(lambda actors: metrics.exists() and metrics.read_text().count("\n") >= 1)
    t0 = time.monotonic()
    with pytest.raises(LearnerError) as e:
        launch_learners(LearnerGroup(2), _rank_entry, [str(recipe), "--out", str(out)], print_fn=lambda s: None,
                        on_started=on_started)
    assert time.monotonic() - t0 < BOUND_S + 60, "the launch did not end after the kill"
    assert killed and str(e.value).startswith("learner rank 1 failed: ActorDiedError"), str(e.value)
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert 1 <= len(logged) < 40 and not (out / "checkpoints" / "sft" / "final").exists()  # stopped mid-run
    ended = time.monotonic()
    print(f"\nkilled rank 1 after step {logged[0]} ({killed[0][1] - t0:.1f} s after the launch): the launch raised "
          f"{ended - killed[0][1]:.1f} s after the kill, {len(logged)} of 40 steps logged")


@pytest.mark.slow
def test_one_learner_actor_with_a_rollout_worker_equals_one_process(tmp_path):
    """`--nproc 1 --launcher ray` with `placement: {rollout_workers: 1}`: the learner in one Ray actor, its
    rollouts on another (started from the learner's actor) — the samples one process draws, so the same
    final weights, bitwise (3 GRPO steps; the test's recipe moves weights by ~1e-2)."""
    from test_distributed import grpo_recipe

    d = grpo_recipe()
    d["stages"][0].update({"steps": 3, "save_every": 100})
    plain, placed = tmp_path / "grpo.yaml", tmp_path / "placed.yaml"
    plain.write_text(yaml.safe_dump(d))
    placed.write_text(yaml.safe_dump({**d, "placement": {"mode": "split", "rollout_workers": 1}}))
    run_one(plain, tmp_path / "one")
    said = run_one(placed, tmp_path / "ray", "--launcher", "ray")
    assert "launching 1 learner ranks as Ray actors" in said
    a, b = weights(tmp_path / "one", "grpo"), weights(tmp_path / "ray", "grpo")
    assert max_diff(a, weights(tmp_path / "one", "base")) > 1e-3
    assert all(bool((a[k] == b[k]).all()) for k in a)
    rows = [json.loads(line) for line in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    assert [r["sync/bytes"] > 0 for r in rows] == [True] * 3  # the weights went to the worker after every step
    workers = {json.loads(line).get("worker") for line in (tmp_path / "ray" / "phases.jsonl").read_text().splitlines()}
    assert "rollout0" in workers
