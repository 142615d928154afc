"""Atomic, verified, resumable checkpoints: HF-format weights + tokenizer + the full trainer state.

Layout under `runs/<name>/checkpoints/<stage>/`:
    step-000050/   model.safetensors, config.json, tokenizer files, trainer_state.pt, trainer_state.json,
                   manifest.json
    final/         the same, written once the stage finished (what the next stage starts from)

A sharded step checkpoint (`distributed.strategy: fsdp`) holds `shards/` instead of `model.safetensors`
and the optimizer state: the weights and AdamW state as torch.distributed.checkpoint writes them, one
`__<rank>_0.distcp` per rank plus `.metadata` — every rank writes its own into a staging folder
`.shards-step-NNNNNN/`, then rank 0 moves it into the temporary folder and publishes as below (the
manifest covers the shard files too). Its `final` is HF-format whole weights, gathered once.

Atomicity: everything is written into a hidden temporary sibling folder, then `manifest.json` (every
file's name, size and SHA-256 hash, read back from the disk) is written last, every file and the
folder are fsync'ed, one `rename` publishes it and the parent is fsync'ed. A crash at any moment leaves
either the old set of checkpoints or the old set plus one complete new one; the last good checkpoint
is only pruned after its successor is published. Leftover temporary folders are ignored and swept.

Integrity: a published folder can still be damaged afterwards (a copy cut short, a full disk on a
network filesystem, a flipped bit). `verify_checkpoint` re-reads every file against the manifest;
resume trusts only checkpoints that pass it (docs/run_dir.md).

Faults while saving: an `OSError` (disk full, I/O error) while the temporary folder is written removes
it and raises `CheckpointWriteError` — one line naming the folder, the error and the space needed — so
the previous checkpoint stays the newest one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from posttrain.distributed import World
from posttrain.distributed.fsdp import save_shards
from posttrain.models import save_model

STATE_FILE = "trainer_state.pt"
SUMMARY_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "posttrain-manifest/1"
HASH = "sha256"  # with the CPU's SHA extensions (x86 SHA-NI, ARMv8 SHA2) ~1.9× BLAKE2b here: 150 vs 80 MB/s on a loaded 2-core VM
FINAL = "final"
SHARDS_DIR = "shards"  # torch.distributed.checkpoint files of a sharded checkpoint
SHARD_STAGING = ".shards-"  # prefix of the folder every rank writes its shards into before rank 0 publishes them
SET_ASIDE = ".corrupt-"  # prefix of a checkpoint that failed verification and was moved out of the way


class CheckpointError(ValueError):
    """A folder that holds no checkpoint we can resume from."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (disk full, I/O error); the previous one is intact."""


class Fault(NamedTuple):
    """Why a checkpoint folder failed verification: the file (relative to the folder) and what is wrong."""

    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


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


# ---- manifest --------------------------------------------------------------------------------------


def file_hash(path: Path, algorithm: str = HASH) -> str:
    """SHA-256 (or `algorithm`) of a file, streamed (hashlib reads it in blocks; memory stays flat)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


def write_manifest(folder: Path) -> dict[str, Any]:
    """Hash every file under `folder` (read back from the disk, so the hash is of what was written) and
    write `manifest.json` beside them. Returns the manifest."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    manifest = {"format": MANIFEST_FORMAT, "hash": HASH,
                "files": [{"path": p.relative_to(folder).as_posix(), "bytes": p.stat().st_size, HASH: file_hash(p)}
                          for p in files]}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    return manifest


def verify_checkpoint(folder: Path) -> list[Fault]:
    """Every way `folder` differs from its manifest (empty: it verifies). Sizes are checked before any
    hash, so a truncated file is named as such without reading the rest."""
    mpath = folder / MANIFEST_FILE
    try:
        manifest = json.loads(mpath.read_text())
        algorithm = str(manifest.get("hash", HASH))  # the manifest names its hash: older ones stay checkable
        if algorithm not in hashlib.algorithms_guaranteed:
            raise ValueError(f"unknown hash {algorithm!r}")
        entries = [(str(e["path"]), int(e["bytes"]), str(e[algorithm])) for e in manifest["files"]]
    except FileNotFoundError:
        return [Fault(MANIFEST_FILE, "missing (not written by a complete save)")]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        return [Fault(MANIFEST_FILE, f"unreadable ({type(e).__name__}: {e})")]
    faults: list[Fault] = []
    for name, size, digest in entries:
        p = folder / name
        try:
            actual = p.stat().st_size
            if actual != size:
                cut = " (truncated)" if actual < size else ""
                faults.append(Fault(name, f"{actual:,} bytes, the manifest says {size:,}{cut}"))
            elif file_hash(p, algorithm) != digest:
                faults.append(Fault(name, f"content differs from the manifest ({algorithm} mismatch)"))
        except FileNotFoundError:
            faults.append(Fault(name, "missing"))
        except OSError as e:
            faults.append(Fault(name, f"unreadable ({e.strerror or e})"))
    return faults


def checkpoint_folders(run_dir: Path) -> list[Path]:
    """Every published checkpoint folder of a run (hidden temporary and set-aside folders excluded)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for stage in root.iterdir() if stage.is_dir() and not stage.name.startswith(".")
                  for p in stage.iterdir() if p.is_dir() and (p.name == FINAL or p.name.startswith("step-")))


class Verified(NamedTuple):
    """One checkpoint folder checked against its manifest."""

    folder: Path
    files: int  # files the manifest lists
    bytes: int  # their total size, as the manifest gives it
    faults: list[Fault]  # empty: it verifies


def verify_run(run_dir: Path) -> list[Verified]:
    """Every published checkpoint of a run, verified (in folder order: base, then each stage)."""
    out = []
    for folder in checkpoint_folders(run_dir):
        faults = verify_checkpoint(folder)
        try:
            listed = json.loads((folder / MANIFEST_FILE).read_text())["files"]
            files, size = len(listed), sum(int(e["bytes"]) for e in listed)
        except (OSError, ValueError, KeyError, TypeError):
            files, size = 0, 0
        out.append(Verified(folder, files, size, faults))
    return out


def set_aside(folder: Path) -> Path:
    """Move a checkpoint that failed verification out of resume's way, keeping it for inspection."""
    target = folder.parent / f"{SET_ASIDE}{folder.name}"
    if target.exists():
        shutil.rmtree(target)
    os.rename(folder, target)
    _fsync_dir(folder.parent)
    return target


# ---- atomic publish ---------------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _space_needed(folder: Path, size_hint: int | None, written: int) -> int:
    """What a save of `folder` needs on disk: the caller's estimate, else the largest published sibling
    (step checkpoints of one stage have one size), else at least what had been written when it failed."""
    siblings = [p for p in folder.parent.iterdir() if p.is_dir() and not p.name.startswith(".")] if folder.parent.is_dir() else []
    known = max((_tree_bytes(p) for p in siblings), default=0)
    return max(size_hint or 0, known, written)


def write_failure(e: BaseException) -> str | None:
    """`ERRNO: message` when `e` is a failed write (None: some other error, which is re-raised).

    Writers report it three ways: an OSError (json, tokenizer files, fsync); safetensors' Rust writer
    raises SafetensorError "… I/O error: No space left on device (os error 28)"; torch.save raises a
    RuntimeError from its zip writer ("PytorchStreamWriter failed writing file …: file write failed", or
    "[enforce fail at inline_container.cc] unexpected pos …" on a short write) with no errno at all."""
    if isinstance(e, OSError):
        return f"{errno.errorcode.get(e.errno or 0, type(e).__name__)}: {e.strerror or e}"
    text = str(e)
    if type(e).__name__ == "SafetensorError" and (m := re.search(r"os error (\d+)", text)):
        code = int(m.group(1))
        return f"{errno.errorcode.get(code, 'errno ' + str(code))}: {os.strerror(code)}"
    if isinstance(e, RuntimeError) and any(k in text for k in ("PytorchStreamWriter", "inline_container", "file write failed")):
        # torch's zip writer: "file write failed", or "unexpected pos N vs M" when a short write moved it
        return "write failed: torch.save could not write the trainer state"
    return None


def publish(folder: Path, write: Callable[[Path], None], *, size_hint: int | None = None) -> Path:
    """Write a folder atomically: `write(tmp)` fills a temporary sibling, the manifest is added last,
    then one rename publishes it.

    An OSError while writing (ENOSPC, EIO, EDQUOT, …) removes the temporary folder and raises
    CheckpointWriteError naming `folder`, the error, the free space and the space the save needs.
    `size_hint`: the caller's estimate of the checkpoint's size in bytes, for that message."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        write(tmp)
        write_manifest(tmp)
        _fsync_tree(tmp)
    except Exception as e:  # any failure removes the partial folder; only a failed write becomes one line
        what = write_failure(e)
        written = _tree_bytes(tmp) if tmp.exists() else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if what is None:
            raise
        free = shutil.disk_usage(folder.parent).free
        need = _space_needed(folder, size_hint, written)
        if what.startswith("write failed") and free < need:  # torch.save gives no errno; the numbers say it
            what = f"ENOSPC: No space left on device; {what}"
        raise CheckpointWriteError(
            f"{folder}: checkpoint not written ({what}); the save needs about {_human(need)}, "
            f"{_human(free)} is free on that filesystem; the partial folder was removed and the previous "
            f"checkpoint is kept — free space (or move the run) and continue with --resume") from None
    if folder.exists():  # only `final` is ever re-published (a stage re-run); step folders are unique
        shutil.rmtree(folder)
    os.rename(tmp, folder)
    _fsync_dir(folder.parent)
    return folder


def _state_bytes(obj: Any, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes of the tensors inside a (nested) state dict, each storage once (tied embeddings are one
    tensor on disk): what save_pretrained and torch.save will write, near enough."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = (obj.data_ptr(), obj.numel())
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v, seen) for v in obj)
    return 0


def checkpoint_name(step: int, final: bool) -> str:
    """The folder a stage's checkpoint of `step` is published as: `step-NNNNNN`, or `final`."""
    return FINAL if final else f"step-{step:06d}"


def save_checkpoint(stage_dir: Path, model, tokenizer, state: dict[str, Any], *, keep_last: int, final: bool = False,
                    weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Publish `step-NNNNNN/` (or `final/`) with weights, tokenizer and `state`; prune old step folders.
    `weights`: the whole weights to write instead of `model.state_dict()` (an FSDP model's, gathered)."""
    step = int(state["step"])
    name = checkpoint_name(step, final)

    def write(tmp: Path) -> None:
        if weights is None:
            save_model(model, tokenizer, tmp)
        else:
            model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        torch.save({**state, "rng": rng_state()}, tmp / STATE_FILE)
        summary = {"step": step, "stage": state.get("stage"), "final": final}
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))

    seen: set[tuple[int, int]] = set()
    size = _state_bytes(dict(weights if weights is not None else model.state_dict()), seen) + _state_bytes(state, seen)
    path = publish(stage_dir / name, write, size_hint=size)
    _prune(stage_dir, path, keep_last)
    return path


def _prune(stage_dir: Path, path: Path, keep_last: int) -> None:
    steps = sorted(stage_dir.glob("step-*"))
    for old in steps[:-keep_last]:
        shutil.rmtree(old)
    for leftover in [*stage_dir.glob(".tmp-*"), *stage_dir.glob(f"{SHARD_STAGING}*")]:
        if leftover != path:
            shutil.rmtree(leftover, ignore_errors=True)


def is_sharded_checkpoint(folder: Path) -> bool:
    """The checkpoint holds torch.distributed.checkpoint shards (`shards/.metadata`), not HF weights."""
    return (folder / SHARDS_DIR / ".metadata").is_file()


def save_sharded_checkpoint(stage_dir: Path, model, optimizer: torch.optim.Optimizer, tokenizer, state: dict[str, Any], *,
                            ranks: World, keep_last: int) -> Path:
    """Publish `step-NNNNNN/` with the weights and optimizer state sharded (`shards/`), the tokenizer, the
    model's config and `state` (schedule, data position, guard; RNG added here). Every rank calls it: each
    writes its shards into the staging folder rank 0 made, then rank 0 moves them into the temporary
    folder and publishes it atomically, manifest last (`publish`). Three sync points with every rank."""
    name = checkpoint_name(int(state["step"]), False)
    staging = stage_dir / f"{SHARD_STAGING}{name}"
    if ranks.is_main:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    ranks.barrier()  # the staging folder exists for every rank
    save_shards(model, optimizer, staging)  # every rank writes its own shards; a collective
    ranks.barrier()  # every rank's shards are on disk
    path = stage_dir / name
    if ranks.is_main:
        def write(tmp: Path) -> None:
            os.rename(staging, tmp / SHARDS_DIR)
            model.config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            torch.save({**state, "rng": rng_state()}, tmp / STATE_FILE)
            summary = {"step": int(state["step"]), "stage": state.get("stage"), "final": False, "sharded": ranks.world_size}
            (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))

        shard_bytes = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
        path = publish(path, write, size_hint=shard_bytes + _state_bytes(state))
        _prune(stage_dir, path, keep_last)
    ranks.barrier()  # a sync point: the checkpoint is published for every rank
    return path


def latest_checkpoint(stage_dir: Path) -> Path | None:
    """The newest published step folder of a stage (published folders are complete by construction;
    on resume the pipeline first sets aside any that fails `verify_checkpoint`)."""
    steps = sorted(p for p in stage_dir.glob("step-*") if (p / STATE_FILE).is_file() and (p / MANIFEST_FILE).is_file())
    return steps[-1] if steps else None


def final_checkpoint(stage_dir: Path) -> Path | None:
    p = stage_dir / FINAL
    return p if (p / SUMMARY_FILE).is_file() and (p / MANIFEST_FILE).is_file() else None


def load_state(checkpoint: Path) -> dict[str, Any]:
    if not (checkpoint / STATE_FILE).is_file():
        raise CheckpointError(f"{checkpoint}: no {STATE_FILE}; not a resumable checkpoint")
    # weights_only=False: the state holds numpy RNG state and python tuples we wrote ourselves.
    try:
        return torch.load(checkpoint / STATE_FILE, weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # a file damaged after verification
        raise CheckpointError(f"{checkpoint / STATE_FILE}: unreadable ({type(e).__name__}: {str(e).splitlines()[0]})") from None
