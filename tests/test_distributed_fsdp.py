"""FSDP2 (`distributed: {strategy: fsdp}`, docs/distributed.md): two gloo processes against one, same recipe,
same global batch — final weights equal within fp32 round-off (printed); sharded checkpoints through
torch.distributed.checkpoint, and resume across world sizes and strategies (2 → 2, 2 → 1, 1 → 2, fsdp ↔
replicate), each printed as max |Δw| against the uninterrupted run; and the FSDP pieces by hand in a
2-process group.

`pytest -m "not slow" tests/test_distributed_fsdp.py`: the pieces (one spawned 2-process group).
`pytest -s -m slow tests/test_distributed_fsdp.py`: the whole runs (each test ≤ 60 s on 2 idle cores; the
module's two shared runs — 1-process SFT, 2-rank FSDP SFT — are made once, by the first test that needs them).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from fsdp_collectives import fsdp_pieces
from test_distributed import ROUND_OFF, _free_port, _write, files, grpo_recipe, max_diff, rows, run_one, run_ranks, sft_recipe, weights

from posttrain.pipeline.run import RunError, check_data_parallel
from posttrain.runtime.checkpoint import SHARDS_DIR, verify_checkpoint
from posttrain.runtime.config import Recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def fsdp(recipe: dict) -> dict:
    return {**recipe, "distributed": {"strategy": "fsdp"}}


# ---- the pieces, in a real 2-process gloo group -------------------------------------------------------
def test_fsdp_pieces_in_two_gloo_processes(tmp_path):
    ctx = mp.start_processes(fsdp_pieces, args=(_free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1):  # raises (and ends the other process) when one fails
            assert time.monotonic() < deadline, "the 2-process FSDP test hung"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    assert sorted(p.name for p in tmp_path.glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # one file per rank


def test_fsdp_is_refused_where_it_is_not_built():
    base = {"model": {"init": "tiny-1m"}, "distributed": {"strategy": "fsdp"}}
    data = [{"task": "arithmetic", "n": 64}]
    sft = {"stage": "sft", "batch_size": 8, "grad_accum": 2, "data": data}
    check_data_parallel(Recipe.model_validate({**base, "stages": [sft]}), 2)
    with pytest.raises(RunError, match=r"stages\[1\] \(dpo\): the dpo stage does not run with distributed.strategy fsdp"):
        check_data_parallel(Recipe.model_validate({**base, "stages": [sft, {"stage": "dpo", "data": data}]}), 2)
    with pytest.raises(RunError, match="fsdp with model.lora is not supported"):
        check_data_parallel(Recipe.model_validate({**base, "model": {"init": "tiny-1m", "lora": {"r": 4}}, "stages": [sft]}), 2)
    with pytest.raises(ValueError, match="strategy"):
        Recipe.model_validate({**base, "distributed": {"strategy": "ddp"}, "stages": [sft]})


# ---- whole runs ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory) -> dict[str, Path]:
    """The SFT recipe of tests/test_distributed.py (6 steps, checkpoint at step 3): one process
    (replicate) and 2 ranks with FSDP, run once for the module."""
    tmp = tmp_path_factory.mktemp("fsdp_sft")
    out = {"recipe": _write(tmp, sft_recipe()), "fsdp_recipe": _write(tmp, fsdp(sft_recipe()), "fsdp.yaml"),
           "one": tmp / "one", "two": tmp / "two"}
    run_one(out["recipe"], out["one"])
    said = run_ranks(2, out["fsdp_recipe"], out["two"])
    assert "sft: FSDP2 over 2 ranks" in said
    return out


def killed_after_step_3(run: Path, to: Path) -> Path:
    """A copy of `run` as if killed right after its step-3 checkpoint (its `final` removed)."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "checkpoints" / "sft" / "final")
    return to


@pytest.mark.slow
def test_sft_fsdp_two_ranks_equal_one_process(sft_runs):
    one, two = sft_runs["one"], sft_runs["two"]
    diff = max_diff(weights(one, "sft"), weights(two, "sft"))
    moved = max_diff(weights(one, "sft"), weights(one, "base"))
    print(f"\nSFT, 6 steps, FSDP2 on 2 ranks: max |w(2 ranks) − w(1 process)| = {diff:.3g} (training moved weights by up to {moved:.3g})")
    assert moved > 1e-3 and diff <= ROUND_OFF
    assert rows(two) == rows(one) == [("sft", s) for s in range(1, 7)]
    # the step checkpoint is sharded: one file per rank plus the metadata, covered by the manifest;
    # `final` is the HF-format whole weights (what the next stage and `posttrain eval` read)
    step = two / "checkpoints" / "sft" / "step-000003"
    assert sorted(p.name for p in (step / SHARDS_DIR).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (step / "model.safetensors").exists() and verify_checkpoint(step) == []
    listed = {e["path"] for e in json.loads((step / "manifest.json").read_text())["files"]}
    assert {f"{SHARDS_DIR}/__0_0.distcp", f"{SHARDS_DIR}/__1_0.distcp", "trainer_state.pt"} <= listed
    assert verify_checkpoint(two / "checkpoints" / "sft" / "final") == []
    assert not any(".shards-" in f or ".tmp-" in f for f in files(two))  # no staging folder left behind
    assert files(two) - files(one) == {f"checkpoints/sft/step-000003/{SHARDS_DIR}"} | {
        f"checkpoints/sft/step-000003/{SHARDS_DIR}/{n}" for n in (".metadata", "__0_0.distcp", "__1_0.distcp")}


@pytest.mark.slow
def test_sft_fsdp_resume_two_to_two_is_exact(sft_runs, tmp_path):
    """Killed after step 3 at 2 FSDP ranks, resumed at 2: the same shards, the same micro-batches — bitwise."""
    two = sft_runs["two"]
    out = killed_after_step_3(two, tmp_path / "fsdp-2")
    assert "resuming sft from step-000003" in run_ranks(2, sft_runs["fsdp_recipe"], out, "--resume")
    d = max_diff(weights(two, "sft"), weights(out, "sft"))
    print(f"SFT killed after step 3 at fsdp-2, resumed at fsdp-2: max |w − w(fsdp-2, uninterrupted)| = {d:.3g}")
    assert rows(out) == rows(two) and d == 0.0


@pytest.mark.slow
def test_sft_fsdp_resume_two_to_one(sft_runs, tmp_path):
    """Killed after step 3 at 2 FSDP ranks, resumed by one process under fsdp and under replicate
    (torch.distributed.checkpoint reassembles the 2 ranks' pieces into whole tensors)."""
    two = sft_runs["two"]
    for name, launch in (("fsdp-1", lambda out: run_one(sft_runs["fsdp_recipe"], out, "--resume")),
                         ("replicate-1", lambda out: run_one(sft_runs["recipe"], out, "--resume"))):
        out = killed_after_step_3(two, tmp_path / name)
        assert "resuming sft from step-000003" in launch(out)
        d = max_diff(weights(two, "sft"), weights(out, "sft"))
        print(f"SFT killed after step 3 at fsdp-2, resumed at {name}: max |w − w(fsdp-2, uninterrupted)| = {d:.3g}")
        assert rows(out) == rows(two) and d <= ROUND_OFF


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
def test_sft_resume_one_to_two(sft_runs, tmp_path, strategy):
    """Killed after step 3 in one process (replicate: HF weights + the whole AdamW state), resumed at 2
    replicated ranks, and at 2 FSDP ranks (the whole optimizer state sharded on load)."""
    one = sft_runs["one"]
    out = killed_after_step_3(one, tmp_path / strategy)
    recipe = sft_runs["recipe" if strategy == "replicate" else "fsdp_recipe"]
    assert "resuming sft from step-000003" in run_ranks(2, recipe, out, "--resume")
    d = max_diff(weights(one, "sft"), weights(out, "sft"))
    print(f"SFT killed after step 3 in 1 process (replicate), resumed at {strategy}-2: max |w − w(1 process)| = {d:.3g}")
    assert rows(out) == rows(one) and d <= ROUND_OFF


@pytest.mark.slow
def test_sft_fsdp_one_process_writes_shards_that_two_ranks_resume(sft_runs, tmp_path):
    """`strategy: fsdp` in one process trains the plain model (nothing to shard over) but writes its step
    checkpoints sharded, so 2 FSDP ranks resume them; the 1-process run is the replicate run exactly."""
    alone = tmp_path / "fsdp-1"
    run_one(sft_runs["fsdp_recipe"], alone)
    assert max_diff(weights(alone, "sft"), weights(sft_runs["one"], "sft")) == 0.0
    assert (alone / "checkpoints" / "sft" / "step-000003" / SHARDS_DIR / "__0_0.distcp").is_file()
    out = killed_after_step_3(alone, tmp_path / "fsdp-1-then-2")
    assert "resuming sft from step-000003" in run_ranks(2, sft_runs["fsdp_recipe"], out, "--resume")
    d = max_diff(weights(alone, "sft"), weights(out, "sft"))
    print(f"SFT killed after step 3 at fsdp-1, resumed at fsdp-2: max |w − w(fsdp-1, uninterrupted)| = {d:.3g}")
    assert d <= ROUND_OFF


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory) -> dict[str, Path]:
    """The GRPO recipe of tests/test_distributed.py (4 steps, checkpoint at step 2): one process
    (replicate) and 2 ranks with FSDP, run once for the module."""
    tmp = tmp_path_factory.mktemp("fsdp_grpo")
    out = {"recipe": _write(tmp, grpo_recipe()), "fsdp_recipe": _write(tmp, fsdp(grpo_recipe()), "fsdp.yaml"),
           "one": tmp / "one", "two": tmp / "two"}
    run_one(out["recipe"], out["one"])
    said = run_ranks(2, out["fsdp_recipe"], out["two"])
    assert "grpo: FSDP2 over 2 ranks" in said and "2 ranks × 2 prompts each" in said
    return out


@pytest.mark.slow
def test_grpo_fsdp_two_ranks_equal_one_process(grpo_runs):
    """GRPO under FSDP2: the rollout engine samples from an unsharded copy loaded at each `sync` with
    the gathered weights. The bound is the replicated test's (tests/test_distributed.py): GRPO's
    gradient sums terms that cancel, so a different order of additions shows more than in SFT; there,
    one process with grad_accum 4 → 2 moved the final weights by 5.4e-5."""
    one, two = grpo_runs["one"], grpo_runs["two"]
    diff = max_diff(weights(one, "grpo"), weights(two, "grpo"))
    moved = max_diff(weights(one, "grpo"), weights(one, "base"))
    syncs = {name: [r["seconds"] for r in map(json.loads, (run / "phases.jsonl").read_text().splitlines())
                    if r["name"] == "sync" and r.get("worker", "main") == "main"]  # rank 0's (phases.jsonl holds rank 1's too)
             for name, run in (("one", one), ("two", two))}
    print(f"\nGRPO, 4 steps, FSDP2 on 2 ranks: max |w(2 ranks) − w(1 process)| = {diff:.3g} (training moved weights "
          f"by up to {moved:.3g}); sync phase per step (s): 1 process {[round(s, 3) for s in syncs['one']]}, "
          f"FSDP rank 0 (gather + load into the engine's copy) {[round(s, 3) for s in syncs['two']]}")
    assert moved > 1e-3 and diff <= 5e-4  # 10× that regrouping, as the replicated test allows
    assert rows(two) == rows(one) == [("grpo", s) for s in range(1, 5)]
    assert len(syncs["two"]) == 4


@pytest.mark.slow
def test_grpo_fsdp_resume_two_to_two_and_two_to_one(grpo_runs, tmp_path):
    """GRPO killed after its step-2 checkpoint at 2 FSDP ranks; resumed at 2 FSDP ranks (bitwise: the
    engine's copy is loaded from the resumed shards) and by one replicate process."""
    two = grpo_runs["two"]
    for name, launch in (("fsdp-2", lambda out: run_ranks(2, grpo_runs["fsdp_recipe"], out, "--resume")),
                         ("replicate-1", lambda out: run_one(grpo_runs["recipe"], out, "--resume"))):
        out = tmp_path / name
        shutil.copytree(two, out)
        shutil.rmtree(out / "checkpoints" / "grpo" / "final")
        assert "resuming grpo from step-000002" in launch(out)
        d = max_diff(weights(two, "grpo"), weights(out, "grpo"))
        print(f"GRPO killed after step 2 at fsdp-2, resumed at {name}: max |w − w(fsdp-2, uninterrupted)| = {d:.3g}")
        assert rows(out) == rows(two)
        assert d == 0.0 if name == "fsdp-2" else d <= 1e-5  # the replicated test's 2 → 1 resume: 2.4e-7
