"""`posttrain` as torchrun starts it, for tests/test_distributed.py — plus a check: on every rank but 0,
any write under the run folder (`--out`) raises, so "rank 0 alone writes the run folder" is tested,
not assumed.

    torchrun --standalone --nproc-per-node 2 tests/ddp_worker.py run RECIPE --out RUN_DIR

The check is a Python audit hook (PEP 578) on the events every write of ours begins with: `open` for
writing (the JSONL sinks, JSON files, the recipe), `os.mkdir` (a checkpoint's temporary folder, before
safetensors and torch.save write into it), `os.rename` / `os.replace` (publishing), `os.remove`,
`os.rmdir`, `shutil.rmtree`, `os.truncate`. Writes from native code that no Python call precedes would
escape it; ours all start with one of these.

One exception, by design: a sharded checkpoint (`distributed.strategy: fsdp`) is written by every rank —
each its own `__<rank>_0.distcp` — into the staging folder `checkpoints/<stage>/.shards-<name>/` that
rank 0 made; rank 0 alone publishes it. Writes inside such a folder are allowed; nothing else is.
"""

from __future__ import annotations

import os
import sys

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATH_EVENTS = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.truncate", "os.symlink", "os.link"}


def forbid_writes_under(root: str, rank: str) -> None:
    root = os.path.abspath(root)

    def inside(path: object) -> bool:
        if not isinstance(path, (str, bytes, os.PathLike)):
            return False  # a file descriptor
        p = os.path.abspath(os.fsdecode(path))
        if not (p == root or p.startswith(root + os.sep)):
            return False
        parts = p[len(root):].split(os.sep)
        return not any(part.startswith(".shards-") for part in parts[:-1])  # a rank's own shard file

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & WRITE_FLAGS)
            paths = [path] if writes else []
        elif event in PATH_EVENTS:
            paths = list(args[:2]) if event in ("os.rename", "os.symlink", "os.link") else [args[0]]
        else:
            return
        for p in paths:
            if inside(p):
                raise PermissionError(f"rank {rank} wrote into the run folder: {event} {os.fsdecode(p)}")

    sys.addaudithook(hook)


def main() -> None:
    argv = sys.argv[1:]
    rank = os.environ.get("RANK", "0")
    if rank != "0" and "--out" in argv:
        forbid_writes_under(argv[argv.index("--out") + 1], rank)
    from posttrain.cli import app

    sys.argv = ["posttrain", *argv]
    app()


if __name__ == "__main__":
    main()
