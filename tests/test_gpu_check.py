"""benchmarks/gpu_check.sh's helpers (benchmarks/gpu/): the recipes it writes validate, the async arm is
skipped with a reason where GRPO has no `max_staleness`, and the summary's numbers are read from run
folders as documented (synthetic folders, hand-computed expectations). The script itself was dry-run on
CPU (docs/gpu.md); the GPU path needs a lent GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from posttrain.runtime.config import Recipe

ROOT = Path(__file__).resolve().parent.parent


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", ROOT / "benchmarks" / "gpu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


recipes, summarize = _module("recipes"), _module("summarize")


def test_recipes_validate_and_the_async_arm_needs_max_staleness(tmp_path, capsys):
    for dry in (True, False):
        d = recipes.grpo_recipe("x", model="/models/smollm2", dry_run=dry, steps=4, staleness=None)
        r = Recipe.model_validate(d)
        assert r.stages[0].backend == ("native" if dry else "vllm") and r.device == ("cpu" if dry else "cuda")
    written = recipes.write(tmp_path, model="tiny-1m", dry_run=True, steps=2)
    if recipes.knows_staleness():
        assert [p.name for p in written] == ["sync.yaml", "async.yaml"]
        assert yaml.safe_load((tmp_path / "async.yaml").read_text())["stages"][0]["max_staleness"] == 1
    else:
        assert [p.name for p in written] == ["sync.yaml"]
        assert "no `max_staleness` field" in capsys.readouterr().out
        with pytest.raises(ValueError, match="max_staleness"):  # what writing it anyway would do: named
            Recipe.model_validate(recipes.grpo_recipe("x", model="m", dry_run=True, steps=2, staleness=1))


def _run(path: Path, step_seconds: list[float], phases: list[dict], extra: list[dict]) -> Path:
    path.mkdir()
    (path / "recipe.yaml").write_text("name: x\nstages:\n- stage: grpo\n  steps: 3\n")
    (path / "device.json").write_text(json.dumps({"name": "test", "kind": "gpu", "dtype": "bf16",
                                                  "peaks": {"flops": {"bf16": 1e12}, "bytes_per_s": 1e11}}))
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"stage": "grpo", "step": i + 1, "train/seconds_per_rollout": s, "telemetry/busy": 0.9, **e}) + "\n"
        for i, (s, e) in enumerate(zip(step_seconds, extra))))
    (path / "phases.jsonl").write_text("".join(json.dumps({"stage": "grpo", "busy": None, "parent": None, **p}) + "\n"
                                               for p in phases))
    return path


def test_summary_reads_the_run_folders(tmp_path):
    # sync: generate 1 s moving 5e10 bytes (5e10 B/s = 50% of 1e11 B/s; 1e9 FLOPs: memory-bound), update 1 s
    # of 2e11 FLOPs (20% of 1e12; 1e9 bytes: compute-bound), sync 0.5 s of 1e9 bytes, one step each of 3 steps. Step times 9, 4, 6 → median after the first 5.
    ph = []
    for s in (1, 2, 3):
        b = 3.0 * (s - 1)
        ph += [{"step": s, "name": "generate", "start": b, "seconds": 1.0, "flops": 1e9, "bytes": 5e10, "worker": "rollout0"},
               {"step": s, "name": "update", "start": b + 1, "seconds": 1.0, "flops": 2e11, "bytes": 1e9},
               {"step": s, "name": "sync", "start": b + 2, "seconds": 0.5, "flops": 0.0, "bytes": 1e9}]
    mism = [{"clip/approx_kl": 0.001, "clip/ratio_max": 1.5}, {"clip/approx_kl": 0.003, "clip/ratio_max": 1.1},
            {"clip/approx_kl": 0.002, "clip/ratio_max": 1.3, "is/mismatch_kl": 0.01}]
    sync = _run(tmp_path / "sync", [9.0, 4.0, 6.0], ph, mism)
    a = summarize.arm(sync)
    assert a["step_seconds_median"] == 5.0
    assert a["mbu_generate_pct"] == pytest.approx(50.0) and a["mfu_update_pct"] == pytest.approx(20.0)
    assert a["sync_bytes"] == 1e9 and a["sync_seconds"] == 0.5 and a["busy_line"] == pytest.approx(0.9)
    # means over the steps that logged them: (0.001 + 0.003 + 0.002) / 3 = 0.002; (1.5 + 1.1 + 1.3) / 3 = 1.3
    assert a["mismatch"]["clip/approx_kl"] == pytest.approx(0.002) and a["mismatch"]["clip/ratio_max"] == pytest.approx(1.3)
    assert a["mismatch"]["is/mismatch_kl"] == pytest.approx(0.01)
    # stage span [0, 8.5): rollout0 3 s → 35%; main (update + sync) 4.5 s → 53%
    assert a["workers"] == {"main": pytest.approx(4.5 / 8.5), "rollout0": pytest.approx(3 / 8.5)}
    asy = _run(tmp_path / "async", [9.0, 3.0, 3.0], ph, mism)
    out = tmp_path / "out"
    assert summarize.main([str(out), str(sync), str(asy)]) == 0
    got = json.loads((out / "summary.json").read_text())
    assert got["async_over_sync"] == pytest.approx(3.0 / 5.0)  # medians after the first: 3 / 5
    assert "**async/sync step-time ratio: 0.600**" in (out / "summary.md").read_text()
    assert summarize.main([str(tmp_path / "out2"), str(tmp_path / "missing")]) == 1  # no arm ran: non-zero
