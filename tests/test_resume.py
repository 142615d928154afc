"""Kill a real run with SIGKILL at several moments, resume it, and get bitwise the same final weights.

The uninterrupted run and every killed-and-resumed run use the same recipe, seed and thread count.
Kills land wherever the run happens to be when the watched record appears: mid-stage between
checkpoints, right after a checkpoint, and in the second stage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from conftest import tiny_recipe_dict

pytestmark = pytest.mark.slow


def _start(recipe: Path, out: Path, *, resume: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "posttrain.cli", "run", str(recipe), "--out", str(out)] + (["--resume"] if resume else [])
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "120"})


def _seen(out: Path, stage: str, step: int) -> bool:
    path = out / "metrics.jsonl"
    if not path.exists():
        return False
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("stage") == stage and r.get("step", 0) >= step:
            return True
    return False


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]


def _weights(out: Path) -> dict:
    return load_file(out / "checkpoints" / "sft" / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe_dict()))
    return path


@pytest.fixture(scope="module")
def reference(recipe, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ref") / "run"
    _finish(_start(recipe, out))
    return _weights(out)


@pytest.mark.parametrize(("stage", "step"), [("pretrain", 2), ("pretrain", 4), ("sft", 1), ("sft", 5)])
def test_kill_and_resume_is_bitwise_identical(recipe, reference, tmp_path, stage, step):
    out = tmp_path / "run"
    proc = _start(recipe, out)
    deadline = time.time() + 300
    while not _seen(out, stage, step):
        assert proc.poll() is None, f"run ended before the kill point: {proc.stderr.read()[-2000:]}"
        assert time.time() < deadline, "kill point never reached"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "checkpoints" / "sft" / "final").exists()
    _finish(_start(recipe, out, resume=True))
    resumed = _weights(out)
    assert resumed.keys() == reference.keys()
    for name, tensor in reference.items():
        assert resumed[name].dtype == tensor.dtype
        assert bool((resumed[name] == tensor).all()), f"{name} differs after resume at {stage} step {step}"
    # The metric stream reads as one run: each (stage, step) logged exactly once.
    keys = [(r["stage"], r["step"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert len(keys) == len(set(keys))


# ---- the same with LoRA: the adapter (PEFT's format) resumes bit for bit -------------------------------
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "down_proj"]}  # dropout: RNG in the loop


def _adapter(out: Path) -> dict:
    return load_file(out / "checkpoints" / "sft" / "final" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def lora_recipe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lora_recipe") / "r.yaml"
    d = tiny_recipe_dict()
    d["model"]["lora"] = LORA
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.fixture(scope="module")
def lora_reference(lora_recipe, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lora_ref") / "run"
    _finish(_start(lora_recipe, out))
    assert not (out / "checkpoints" / "sft" / "final" / "model.safetensors").exists()  # the adapter only
    return _adapter(out)


@pytest.mark.parametrize(("stage", "step"), [("pretrain", 4), ("sft", 5)])
def test_lora_kill_and_resume_is_bitwise_identical(lora_recipe, lora_reference, tmp_path, stage, step):
    out = tmp_path / "run"
    proc = _start(lora_recipe, out)
    deadline = time.time() + 300
    while not _seen(out, stage, step):
        assert proc.poll() is None, f"run ended before the kill point: {proc.stderr.read()[-2000:]}"
        assert time.time() < deadline, "kill point never reached"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _finish(_start(lora_recipe, out, resume=True))
    resumed = _adapter(out)
    assert resumed.keys() == lora_reference.keys() and any("lora_B" in k for k in resumed)
    for name, tensor in lora_reference.items():
        assert bool((resumed[name] == tensor).all()), f"{name} differs after resume at {stage} step {step}"
