"""Data-parallel runs (docs/distributed.md): two gloo processes against one, same recipe, same global batch,
same seed — final weights equal within fp32 round-off (the max difference is printed); rank 1 writes
nothing into the run folder (tests/ddp_worker.py forbids it); stages that are not data-parallel are
refused; and the pieces by hand: shards, the collectives of a 2-process gloo group, sampling a shard
of a batch.

`pytest -m "not slow" tests/test_distributed.py`: the unit tests, the collectives and SFT 2 vs 1 (92 s
measured at a load average of 8 on 2 cores, 42 s of CPU). `pytest -m slow tests/test_distributed.py`:
GRPO 2 vs 1 with resume 2 → 2 and 2 → 1, and the CLI's refusal (168 s at the same load).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
import yaml
from safetensors.torch import load_file

from posttrain.distributed import (
    DistributedError,
    World,
    deal,
    init_world,
    shard,
    shard_range,
)
from posttrain.pipeline.run import RunError, check_data_parallel
from ddp_collectives import collectives
from posttrain.runtime.config import Recipe

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "ddp_worker.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
RUN_TIMEOUT_S = 420  # one run on 2 loaded cores takes 10–40 s; a hang is killed long before pytest's patience ends
# fp32 round-off after the SFT test's 6 AdamW steps: in ONE process, changing only grad_accum (4 → 2, 4 → 1;
# the same gradient up to the order of additions) moves the final weights by up to 4.2e-6 and 5.5e-6
ROUND_OFF = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- shards, by hand --------------------------------------------------------------------------------
def test_shards_by_hand():
    items = list("abcdefgh")
    r0, r1 = World(rank=0, world_size=2), World(rank=1, world_size=2)
    assert shard_range(8, r1) == range(4, 8)
    assert shard(items, r0) == list("abcd") and shard(items, r1) == list("efgh")  # contiguous blocks
    assert deal(items, r0) == list("aceg") and deal(items, r1) == list("bdfh")  # round-robin
    assert shard(items, World()) == items == deal(items, World())  # one process: everything
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        shard_range(8, World(rank=0, world_size=3))


def test_one_process_world_collectives_are_the_identity():
    w = World()
    assert w.is_main and w.world_size == 1
    assert w.sum({"a": 1.5}) == {"a": 1.5} and w.max({"a": 1.5}) == {"a": 1.5}
    # a mean whose weights are 0 (nothing to average) is left out, as a missing metric
    assert w.mean({"a": 0.25, "b": 0.0}, {"a": 3.0, "b": 0.0}) == {"a": 0.25}
    w.barrier()  # no process group: nothing to wait for


def test_init_world_reads_torchrun_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert init_world() == World()  # a plain `posttrain run`: one process, no process group
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert init_world() == World()  # torchrun --nproc-per-node 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK")
    with pytest.raises(DistributedError, match="RANK is not"):
        init_world()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(DistributedError, match="0 ≤ RANK < WORLD_SIZE"):
        init_world()
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(DistributedError, match="MASTER_ADDR and MASTER_PORT not set"):
        init_world()
    assert not tdist.is_initialized()


def _recipe(*stages: dict) -> Recipe:
    return Recipe.model_validate({"model": {"init": "tiny-1m"}, "stages": list(stages)})


DATA = [{"task": "arithmetic", "n": 64}]


def test_stages_that_are_not_data_parallel_are_refused_by_name():
    sft = {"stage": "sft", "batch_size": 8, "grad_accum": 1, "data": DATA}
    check_data_parallel(_recipe(sft), 2)  # 8 sequences: 2 ranks × 1 micro-batch of 4
    with pytest.raises(RunError, match=r"stages\[1\] \(rs\): the rejection_sampling stage does not run data-parallel yet"):
        check_data_parallel(_recipe(sft, {"stage": "rejection_sampling", "name": "rs", "data": DATA}), 2)
    check_data_parallel(_recipe(sft, {"stage": "rejection_sampling", "data": DATA}), 1)  # one process runs everything
    check_data_parallel(_recipe(sft, {"stage": "dpo", "batch_size": 8, "grad_accum": 2, "data": DATA}), 2)
    with pytest.raises(RunError, match=r"stages\[1\] \(dpo\): dpo: batch_size 6 \(pairs\) does not split into 4"):
        check_data_parallel(_recipe(sft, {"stage": "dpo", "batch_size": 6, "grad_accum": 3, "data": DATA}), 2)
    with pytest.raises(RunError, match="batch_size 6 does not split into 4 micro-batches"):
        check_data_parallel(_recipe({**sft, "batch_size": 6, "grad_accum": 3}), 2)  # 3 → 2 ranks × 2
    grpo = {"stage": "grpo", "batch_size": 16, "group_size": 4, "data": DATA}
    check_data_parallel(_recipe(grpo), 2)
    with pytest.raises(RunError, match="dynamic_sampling cannot run data-parallel yet"):
        check_data_parallel(_recipe({**grpo, "dynamic_sampling": True}), 2)
    with pytest.raises(RunError, match="4 prompts per rollout .* do not split over 3 ranks"):
        check_data_parallel(_recipe(grpo), 3)
    with pytest.raises(RunError, match="rejection_sampling stage does not run data-parallel"):
        check_data_parallel(_recipe({"stage": "rejection_sampling", "data": DATA}), 2)


def test_sampling_a_shard_of_a_batch_draws_what_the_whole_batch_draws():
    from posttrain.models import build_tiny, train_tokenizer
    from posttrain.rollout import SamplingParams, make_engine

    tok = train_tokenizer([f"{a} + {b} = {a + b}" for a in range(30) for b in range(10)], vocab_size=300)
    model = build_tiny("tiny-1m", vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    engine = make_engine("native", model, tok)
    prompts = [tok.encode(f"{a} + 3 =") for a in (1, 22, 7, 15)]
    params = dict(n=2, temperature=1.0, max_new_tokens=6, seed=11)
    whole = engine.generate(prompts, SamplingParams(**params))
    halves = [engine.generate(prompts[2 * r : 2 * r + 2], SamplingParams(**params, shard=(4 * r, 8))) for r in (0, 1)]
    assert [t for h in halves for t in h.texts] == whole.texts  # rows 0–3 and 4–7 of the same 8-row draw
    alone = engine.generate(prompts[2:], SamplingParams(**params))  # without `shard`: a batch of its own
    assert alone.texts != halves[1].texts
    with pytest.raises(ValueError, match="are not in a batch of 8"):
        engine.generate(prompts, SamplingParams(**params, shard=(4, 8)))


def test_the_write_guard_of_the_test_worker_catches_writes(tmp_path):
    # tests/ddp_worker.py's audit hook, which the 2-rank runs below rely on: reads pass, writes raise
    run = tmp_path / "run"
    run.mkdir()
    (run / "old.txt").write_text("x")
    script = ("import os, sys; sys.path.insert(0, {tests!r}); from ddp_worker import forbid_writes_under\n"
              "forbid_writes_under({run!r}, '1'); open({run!r} + '/old.txt').read()\n"
              "for f in (lambda: open({run!r} + '/m.jsonl', 'a'), lambda: os.mkdir({run!r} + '/d'),\n"
              "          lambda: os.replace({run!r} + '/old.txt', {run!r} + '/new.txt'), lambda: os.remove({run!r} + '/old.txt'),\n"
              "          lambda: os.open({run!r} + '/x', os.O_WRONLY | os.O_CREAT)):\n"
              "    try:\n        f()\n    except PermissionError as e:\n        print(e)\n"
              "open({tmp!r} + '/outside.txt', 'w').write('fine')\n").format(tests=str(ROOT / "tests"), run=str(run), tmp=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    said = r.stdout.splitlines()
    assert len(said) == 5 and all(line.startswith("rank 1 wrote into the run folder") for line in said), said
    assert sorted(p.name for p in run.iterdir()) == ["old.txt"] and (tmp_path / "outside.txt").exists()


# ---- the collectives of a real 2-process gloo group ---------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collectives_of_two_gloo_processes():
    ctx = mp.start_processes(collectives, args=(_free_port(),), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1):  # raises (and ends the other process) when one fails
            assert time.monotonic() < deadline, "the 2-process collectives test hung"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


# ---- whole runs: 2 ranks against 1 process ----------------------------------------------------------
def _env() -> dict[str, str]:
    # POSTTRAIN_MATMUL_TUNE=0: the decode matmul's form by the static rule, not by a timing (rollout/cpu/tuning.py),
    # so a run's round-off does not hang on the machine's load at the moment it measured: one process generates 8
    # rows where each of 2 ranks generates 4, two row buckets that a measurement may give different forms
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200",
            "POSTTRAIN_DIST_TIMEOUT_S": "120",  # a rank left waiting gives up after 2 minutes, not 30
            "POSTTRAIN_MATMUL_TUNE": "0"}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run `cmd` in its own session; on a timeout torchrun is asked to stop its workers (SIGTERM), then
    everything left in the session is killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun shuts its workers down on SIGTERM
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise AssertionError(f"timed out after {RUN_TIMEOUT_S} s: {' '.join(cmd)}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def run_one(recipe: Path, out: Path, *more: str) -> str:
    r = _run([sys.executable, "-m", "posttrain.cli", "run", str(recipe), "--out", str(out), *more])
    assert r.returncode == 0, r.stdout[-4000:]
    return r.stdout


def run_ranks(n: int, recipe: Path, out: Path, *more: str, ok: bool = True) -> str:
    """`torchrun --nproc-per-node n` of posttrain, ranks ≥ 1 forbidden to write under `out`."""
    r = _run([str(TORCHRUN), "--standalone", "--nproc-per-node", str(n), str(WORKER), "run", str(recipe),
              "--out", str(out), *more])
    assert (r.returncode == 0) == ok, r.stdout[-6000:]
    return r.stdout


def weights(run: Path, stage: str) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / stage / "final" / "model.safetensors")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def rows(run: Path) -> list[tuple[str, int]]:
    return [(r["stage"], r["step"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def files(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*")}


def _write(tmp: Path, recipe: dict, name: str = "recipe.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def sft_recipe() -> dict:
    # 8 sequences a step in 4 micro-batches: one process runs all 4; each of 2 ranks runs 2 (accumulated
    # locally, then summed over the ranks)
    return {"name": "dp", "seed": 0, "threads": 1, "model": {"init": "tiny-1m", "vocab_size": 400},
            "telemetry": {"measure_cpu": False},
            "stages": [{"stage": "sft", "steps": 6, "batch_size": 8, "grad_accum": 4, "max_len": 96, "heldout": 16,
                        "data": [{"task": "arithmetic", "n": 200}], "save_every": 3, "log_every": 1,
                        "optim": {"lr": 3e-3, "warmup_steps": 2}}]}


def grpo_recipe() -> dict:
    # 4 prompts × G = 4 a rollout (each rank: 2 prompts' groups, 2 micro-batches); the reward is the
    # length in characters of the reply, which differs inside every group even for a random model
    return {"name": "dp", "seed": 0, "threads": 1, "model": {"init": "tiny-1m", "vocab_size": 400},
            "telemetry": {"measure_cpu": False},
            "stages": [{"stage": "grpo", "steps": 4, "batch_size": 16, "group_size": 4, "grad_accum": 4,
                        "max_new_tokens": 8, "kl_coef": 0.05, "save_every": 2, "log_every": 1,
                        "rewards": [{"name": "length", "params": {"max_len": 200, "count": "chars"}}],
                        "data": [{"task": "arithmetic", "n": 64}], "levels": ["L1"],
                        "optim": {"lr": 1e-2, "warmup_steps": 0}}]}


def test_sft_two_ranks_equal_one_process(tmp_path):
    recipe = _write(tmp_path, sft_recipe())
    one, two = tmp_path / "one", tmp_path / "two"
    run_one(recipe, one)
    said = run_ranks(2, recipe, two)
    assert "on 2 ranks (gloo)" in said and "in 4 micro-batches (2 ranks × 2 of 2 sequences)" in said
    diff = max_diff(weights(one, "sft"), weights(two, "sft"))
    moved = max_diff(weights(one, "sft"), weights(one, "base"))
    print(f"\nSFT, 6 steps: max |w(2 ranks) − w(1 process)| = {diff:.3g} (training moved weights by up to {moved:.3g})")
    assert moved > 1e-3  # it trained: the comparison is not between two untouched models
    assert diff <= ROUND_OFF
    # rank 0 alone wrote the run folder (ranks ≥ 1 could not: tests/ddp_worker.py), once per row
    assert rows(two) == rows(one) == [("sft", s) for s in range(1, 7)]
    assert files(two) == files(one)
    assert {"metrics.jsonl", "phases.jsonl", "device.json", "doctor.json", "report.html", "recipe.yaml"} <= files(two)


@pytest.mark.heavy  # 34 s; GRPO over two ranks is in the default run sharded (test_distributed_fsdp.py), replicate with SFT here
def test_grpo_two_ranks_equal_one_process_and_resume_at_two_and_one(tmp_path):
    """GRPO's gradient is a sum of terms that cancel (advantages sum to 0 in a group) and AdamW's first
    steps are ≈ lr · sign(gradient), so its round-off shows more than SFT's: the bound is what one process
    itself shows when only its micro-batching changes (grad_accum 4 → 2, the same gradient up to the order
    of additions), measured here beside it."""
    recipe = _write(tmp_path, grpo_recipe())
    regrouped = grpo_recipe()
    regrouped["stages"][0]["grad_accum"] = 2
    one, one_regrouped, two = tmp_path / "one", tmp_path / "one_regrouped", tmp_path / "two"
    run_one(recipe, one)
    run_one(_write(tmp_path, regrouped, "regrouped.yaml"), one_regrouped)
    said = run_ranks(2, recipe, two)
    assert "2 ranks × 2 prompts each" in said
    round_off = max_diff(weights(one, "grpo"), weights(one_regrouped, "grpo"))
    diff = max_diff(weights(one, "grpo"), weights(two, "grpo"))
    moved = max_diff(weights(one, "grpo"), weights(one, "base"))
    print(f"\nGRPO, 4 steps: max |w(2 ranks) − w(1 process)| = {diff:.3g}; one process, grad_accum 4 vs 2: "
          f"{round_off:.3g} (training moved weights by up to {moved:.3g})")
    assert moved > 1e-3
    # the all-reduce adds the ranks' partial sums in yet another order: within 10× the one-process
    # regrouping (measured 8.2e-6 vs 5.4e-5 on one run, 1.5e-4 vs 5.4e-5 on another) and far under the training's move
    assert 0 < round_off < 1e-3 and diff <= 10 * round_off and diff < 0.1 * moved
    assert rows(two) == rows(one) == [("grpo", s) for s in range(1, 5)]

    # Resume: the run as if killed right after its step-2 checkpoint (final removed), resumed by 2 ranks
    # and by 1 process — each continues from the checkpoint rank 0 wrote.
    for name, launch in (("two_again", lambda out: run_ranks(2, recipe, out, "--resume")),
                         ("two_then_one", lambda out: run_one(recipe, out, "--resume"))):
        out = tmp_path / name
        shutil.copytree(two, out)
        shutil.rmtree(out / "checkpoints" / "grpo" / "final")
        said = launch(out)
        assert "resuming grpo from step-000002" in said
        d = max_diff(weights(two, "grpo"), weights(out, "grpo"))
        print(f"GRPO killed after step 2 at 2 ranks, resumed ({name}): max |w − w(2 ranks, uninterrupted)| = {d:.3g}")
        assert rows(out) == rows(two)
        if name == "two_again":
            assert d == 0.0  # resume at the same world size is exact, as in one process
        assert d <= round_off


@pytest.mark.slow
def test_cli_refuses_a_stage_that_is_not_data_parallel(tmp_path):
    d = sft_recipe()
    d["stages"].append({"stage": "rejection_sampling", "name": "rs", "data": [{"task": "arithmetic", "n": 32}]})
    out = tmp_path / "run"
    said = run_ranks(2, _write(tmp_path, d), out, ok=False)
    assert "stages[1] (rs): the rejection_sampling stage does not run data-parallel yet" in said
    assert not out.exists()  # refused before anything was written


# ---- `posttrain run --nproc N` ------------------------------------------------------------------------
@pytest.mark.slow
def test_run_nproc_two_launches_torchrun_itself(tmp_path):
    # with as many micro-batches as ranks each rank runs exactly one of the micro-batches one process
    # runs, and the sum of 2 gradients is the same float addition in either order: bitwise equal weights
    d = sft_recipe()
    d["stages"][0].update(grad_accum=2, steps=3, save_every=10)
    recipe = _write(tmp_path, d)
    one, two = tmp_path / "one", tmp_path / "two"
    run_one(recipe, one)
    said = run_one(recipe, two, "--nproc", "2")
    assert "launching 2 ranks: torchrun --standalone --nproc-per-node 2 -m posttrain.cli run" in said
    assert "on 2 ranks (gloo)" in said and "in 2 micro-batches (2 ranks × 1 of 4 sequences)" in said
    assert max_diff(weights(one, "sft"), weights(two, "sft")) == 0.0
    assert rows(two) == rows(one)


@pytest.mark.slow  # a CLI start: 8–24 s measured on the shared 2 cores, depending on their load
def test_run_nproc_refuses_a_recipe_before_starting_ranks(tmp_path):
    d = sft_recipe()
    d["stages"][0].update(batch_size=6, grad_accum=3)  # 3 micro-batches → 4 on 2 ranks: 6 does not split
    out = tmp_path / "run"
    r = _run([sys.executable, "-m", "posttrain.cli", "run", str(_write(tmp_path, d)), "--out", str(out), "--nproc", "2"])
    assert r.returncode == 2, r.stdout[-2000:]
    assert "batch_size 6 does not split into 4 micro-batches" in r.stdout and "launching" not in r.stdout
    assert not out.exists()
