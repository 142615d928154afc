"""Saving under faults, on a real full filesystem: a size-capped tmpfs this test mounts (we run as root;
without the privilege to mount, the tests skip and say why).

Sizes (tiny-1m, 855,424 parameters, fp32): the base checkpoint is ≈ 3.4 MB (weights + tokenizer); a
step checkpoint ≈ 10.3 MB (weights + two AdamW moments of the same size + tokenizer). A 20 MiB
(20.97 MB) tmpfs holds the base and pretrain's step-000003 (≈ 13.8 MB) and leaves ≈ 7 MB: step-000006
cannot be written.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_recipe_dict
from posttrain.models import build_tiny
from posttrain.runtime.checkpoint import CheckpointWriteError, save_checkpoint, verify_checkpoint


@pytest.fixture
def small_fs(tmp_path):
    def mount(size: str) -> Path:
        mnt = tmp_path / f"fs-{size}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a size-capped tmpfs here ({r.stderr.strip() or r.returncode}); "
                        f"the disk-full tests need one")
        mounted.append(mnt)
        return mnt

    mounted: list[Path] = []
    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(small_fs, tokenizer):
    fs = small_fs("5m")
    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), seed=0, pad_token_id=tokenizer.pad_token_id)
    state = {"stage": "sft", "step": 3, "optimizer": {}, "scheduler": {}, "data": None}
    stage = fs / "checkpoints" / "sft"
    good = save_checkpoint(stage, model, tokenizer, state, keep_last=2)          # ≈ 3.4 MB: fits
    with pytest.raises(CheckpointWriteError) as e:                               # a second 3.4 MB: 5 MiB (5.2 MB) is full
        save_checkpoint(stage, model, tokenizer, {**state, "step": 6}, keep_last=2)
    msg = str(e.value)
    assert "\n" not in msg
    size = sum(p.stat().st_size for p in good.rglob("*") if p.is_file())       # ≈ 3.4 MB: a second one
    assert msg.startswith(f"{stage / 'step-000006'}: checkpoint not written (ENOSPC: No space left on device); "
                          f"the save needs about {size / 1e6:.1f} MB, ")
    assert "is free on that filesystem" in msg
    assert sorted(p.name for p in stage.iterdir()) == ["step-000003"]            # the partial folder is gone
    assert verify_checkpoint(good) == []


def _run(recipe: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "posttrain.cli", *args, *([str(recipe), "--out", str(out)] if args[0] == "run" else [str(out)])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "400"})


def test_cli_run_on_a_full_disk_stops_in_one_line_with_exit_2(small_fs, tmp_path):
    fs = small_fs("20m")
    d = tiny_recipe_dict(threads=1, telemetry={"measure_cpu": False})
    d["stages"] = d["stages"][:1]  # pretrain: step-000003 fits, step-000006 does not
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(d))
    out = fs / "run"
    r = _run(recipe, out, "run")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stdout + r.stderr
    assert f"{out / 'checkpoints' / 'pretrain' / 'step-000006'}: checkpoint not written (ENOSPC" in errors[0]
    assert "the save needs about 10.3 MB" in errors[0]                           # the step-000003 beside it
    stage = out / "checkpoints" / "pretrain"
    assert sorted(p.name for p in stage.iterdir()) == ["step-000003"]
    v = _run(recipe, out, "verify")                                              # base + step-000003 verify
    assert v.returncode == 0 and "all 2 checkpoints verify" in v.stdout, v.stdout


def test_an_io_error_is_named_too(monkeypatch, tmp_path, tokenizer):
    import posttrain.runtime.checkpoint as ckpt

    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), seed=0, pad_token_id=tokenizer.pad_token_id)
    state = {"stage": "sft", "step": 3, "optimizer": {}, "scheduler": {}, "data": None}
    good = save_checkpoint(tmp_path, model, tokenizer, state, keep_last=2)

    def eio(*_a, **_k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ckpt.torch, "save", eio)
    with pytest.raises(CheckpointWriteError, match=r"step-000006: checkpoint not written \(EIO: Input/output error\)"):
        save_checkpoint(tmp_path, model, tokenizer, {**state, "step": 6}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003"] and verify_checkpoint(good) == []
