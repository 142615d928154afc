"""Atomic, resumable checkpoints: HF-format weights + tokenizer + the full trainer state.

Layout under `runs/<name>/checkpoints/<stage>/`:
    step-000050/   model.safetensors, config.json, tokenizer files, trainer_state.pt, trainer_state.json
    final/         the same, written once the stage finished (what the next stage starts from)

Atomicity: everything is written into a hidden temporary sibling folder, every file and the folder are
fsync'ed, then one `rename` publishes it and the parent is fsync'ed. A crash at any moment leaves
either the old set of checkpoints or the old set plus one complete new one; the last good checkpoint
is only pruned after its successor is published. Leftover temporary folders are ignored and swept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.models import save_model

STATE_FILE = "trainer_state.pt"
SUMMARY_FILE = "trainer_state.json"
FINAL = "final"


class CheckpointError(ValueError):
    """A folder that holds no checkpoint we can resume from."""


def _fsync_tree(folder: Path) -> None:
    for root, _dirs, files in os.walk(folder):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def publish(folder: Path, write: callable) -> Path:
    """Write a folder atomically: `write(tmp)` fills a temporary sibling, then one rename publishes it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write(tmp)
    _fsync_tree(tmp)
    if folder.exists():  # only `final` is ever re-published (a stage re-run); step folders are unique
        shutil.rmtree(folder)
    os.rename(tmp, folder)
    _fsync_dir(folder.parent)
    return folder


def save_checkpoint(stage_dir: Path, model, tokenizer, state: dict[str, Any], *, keep_last: int, final: bool = False) -> Path:
    """Publish `step-NNNNNN/` (or `final/`) with weights, tokenizer and `state`; prune old step folders."""
    step = int(state["step"])
    name = FINAL if final else f"step-{step:06d}"

    def write(tmp: Path) -> None:
        save_model(model, tokenizer, tmp)
        torch.save({**state, "rng": rng_state()}, tmp / STATE_FILE)
        summary = {"step": step, "stage": state.get("stage"), "final": final}
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))

    path = publish(stage_dir / name, write)
    steps = sorted(stage_dir.glob("step-*"))
    for old in steps[:-keep_last]:
        shutil.rmtree(old)
    for leftover in stage_dir.glob(".tmp-*"):
        if leftover != path:
            shutil.rmtree(leftover, ignore_errors=True)
    return path


def latest_checkpoint(stage_dir: Path) -> Path | None:
    """The newest complete step folder of a stage (published folders are complete by construction)."""
    steps = sorted(p for p in stage_dir.glob("step-*") if (p / STATE_FILE).is_file())
    return steps[-1] if steps else None


def final_checkpoint(stage_dir: Path) -> Path | None:
    p = stage_dir / FINAL
    return p if (p / SUMMARY_FILE).is_file() else None


def load_state(checkpoint: Path) -> dict[str, Any]:
    if not (checkpoint / STATE_FILE).is_file():
        raise CheckpointError(f"{checkpoint}: no {STATE_FILE}; not a resumable checkpoint")
    # weights_only=False: the state holds numpy RNG state and python tuples we wrote ourselves.
    return torch.load(checkpoint / STATE_FILE, weights_only=False)
