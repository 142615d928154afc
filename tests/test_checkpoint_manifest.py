"""Checkpoint manifests: written last inside the atomic publish, and every kind of damage named on verify."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from posttrain.runtime.checkpoint import (
    MANIFEST_FILE, CheckpointWriteError, Fault, file_hash, publish, verify_checkpoint, verify_run,
)


def _write(tmp: Path) -> None:
    (tmp / "model.safetensors").write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    (tmp / "config.json").write_text('{"a": 1}')
    (tmp / "sub").mkdir()
    (tmp / "sub" / "x.bin").write_bytes(b"abc")


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return publish(tmp_path / "checkpoints" / "sft" / "step-000003", _write)


def test_manifest_lists_every_file_with_size_and_hash(ckpt):
    m = json.loads((ckpt / MANIFEST_FILE).read_text())
    files = {e["path"]: e for e in m["files"]}
    assert sorted(files) == ["config.json", "model.safetensors", "sub/x.bin"]  # the manifest does not list itself
    assert files["model.safetensors"]["bytes"] == 10_240                        # 256 × 40
    assert files["sub/x.bin"]["sha256"] == file_hash(ckpt / "sub" / "x.bin")
    # SHA-256 of b"abc" (FIPS 180-2, appendix B.1) is ba7816bf 8f01cfea …
    assert files["sub/x.bin"]["sha256"].startswith("ba7816bf8f01cfea")
    assert verify_checkpoint(ckpt) == []
    assert not list(ckpt.parent.glob(".tmp-*"))


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "file", "problem"), [
    ("half", "model.safetensors", "5,120 bytes, the manifest says 10,240 (truncated)"),
    ("empty", "model.safetensors", "0 bytes, the manifest says 10,240 (truncated)"),
    ("flip", "model.safetensors", "content differs from the manifest (sha256 mismatch)"),
    ("grow", "config.json", "9 bytes, the manifest says 8"),
    ("delete", "sub/x.bin", "missing"),
    ("no manifest", MANIFEST_FILE, "missing (not written by a complete save)"),
    ("bad manifest", MANIFEST_FILE, "unreadable"),
])
def test_each_kind_of_damage_is_named(ckpt, damage, file, problem):
    weights = ckpt / "model.safetensors"
    if damage == "half":
        weights.write_bytes(weights.read_bytes()[:5120])
    elif damage == "empty":
        weights.write_bytes(b"")
    elif damage == "flip":
        _flip(weights, 5000)  # one bit of one byte: same size, different hash
    elif damage == "grow":
        (ckpt / "config.json").write_text('{"a": 10}')
    elif damage == "delete":
        (ckpt / "sub" / "x.bin").unlink()
    elif damage == "no manifest":
        (ckpt / MANIFEST_FILE).unlink()
    else:
        (ckpt / MANIFEST_FILE).write_text('{"files": [')
    faults = verify_checkpoint(ckpt)
    assert len(faults) == 1 and faults[0].file == file
    assert faults[0].problem.startswith(problem), faults[0].problem


def test_verify_run_covers_every_published_folder_and_skips_hidden_ones(tmp_path):
    run = tmp_path / "run"
    publish(run / "checkpoints" / "base" / "final", _write)
    bad = publish(run / "checkpoints" / "sft" / "step-000003", _write)
    publish(run / "checkpoints" / "sft" / "final", _write)
    (run / "checkpoints" / "sft" / ".tmp-final-1").mkdir()        # a kill's leftover: not a checkpoint
    (bad / "config.json").unlink()
    rows = {str(v.folder.relative_to(run)): v for v in verify_run(run)}
    assert sorted(rows) == ["checkpoints/base/final", "checkpoints/sft/final", "checkpoints/sft/step-000003"]
    assert rows["checkpoints/sft/step-000003"].faults == [Fault("config.json", "missing")]
    assert rows["checkpoints/sft/final"].faults == [] and rows["checkpoints/sft/final"].files == 3
    assert rows["checkpoints/sft/final"].bytes == 10_240 + 8 + 3


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_an_os_error_while_writing_removes_the_partial_folder_and_keeps_the_old_one(tmp_path, code):
    stage = tmp_path / "checkpoints" / "sft"
    good = publish(stage / "step-000003", _write)

    def fails_halfway(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"x" * 1000)
        raise OSError(code, "simulated")

    with pytest.raises(CheckpointWriteError) as e:
        publish(stage / "step-000006", fails_halfway, size_hint=50_000)
    msg = str(e.value)
    assert "\n" not in msg and str(stage / "step-000006") in msg and errno.errorcode[code] in msg
    assert "needs about 50.0 KB" in msg                      # the caller's hint beats the 10 KB sibling
    assert sorted(p.name for p in stage.iterdir()) == ["step-000003"]  # no partial folder left
    assert verify_checkpoint(good) == []
