"""The collect step's journal: every judged generation batch of a rejection-sampling stage, one JSON
line each, so a killed stage resumes without generating or judging those batches again.

Judging is what a collect step pays for (a reward model's forward, a sandboxed test run, an AI judge's
endpoint call through `posttrain/judges/`); generation is the rest. A stage that is killed after k of
its n batches has paid for k batches: on resume it reads them back from here and continues at k + 1.
The data files are written once, at the end, from the kept samples of all n batches — the journaled
ones replayed through the same selection code — so a resumed stage writes the same bytes as an
uninterrupted one (each batch's samples are seeded by the recipe seed and the batch index, not by
what ran before it, so batch k + 1 samples the same completions either way).

Format (`<run dir>/journal/<stage folder>.jsonl`):
    {"journal": 1, "stage": "<folder>", "fingerprint": "<sha256 of the stage config and its prompts>"}
    {"step": 1, "texts": [...], "finish": [...], "total": [...], "metrics": {...}}
    {"step": 2, ...}

Atomicity: each batch is one `write` of one line ending in "\\n", then flush + fsync, before the next
batch starts. A kill -9 can tear only the line being written: the reader keeps the longest prefix of
complete, parseable lines whose steps run 1, 2, 3, … and truncates the file there (the torn tail is
dropped, and its batch is generated and judged again — it was never paid for in full on disk).
A journal whose header does not match this stage's fingerprint (another config or other prompts) is
discarded and the stage starts over.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

VERSION = 1


@dataclass(frozen=True)
class JudgedBatch:
    """One generation batch after judging: what the selection code needs to replay it.
    Shapes: texts, finish, total are all (prompts × samples,), prompt-major."""

    step: int
    texts: list[str]
    finish: list[str]  # "stop" | "length" (the engine's finish reasons)
    total: list[float | None]  # summed score; None: a verifier could not judge the sample
    metrics: dict[str, float] = field(default_factory=dict)  # the batch's scoring metrics, as logged

    def as_json(self) -> dict:
        return {"step": self.step, "texts": self.texts, "finish": self.finish, "total": self.total, "metrics": self.metrics}


def journal_path(run_dir: Path, folder: str) -> Path:
    return run_dir / "journal" / f"{folder}.jsonl"


def fingerprint(config_json: str, prompts: list[list[int]], extra: str = "") -> str:
    """What the journal's batches depend on: the stage's config, its encoded prompts and `extra` (e.g.
    the generating model's path). Same fingerprint, same batches (the samples are seeded per batch)."""
    h = hashlib.sha256(config_json.encode())
    h.update(json.dumps(prompts).encode())
    h.update(extra.encode())
    return h.hexdigest()


def _parse(line: bytes, step: int) -> JudgedBatch | None:
    """A complete journal line for batch `step`, or None (torn, unparseable, or out of order)."""
    if not line.endswith(b"\n"):
        return None
    try:
        row = json.loads(line)
        if row.get("step") != step or not (len(row["texts"]) == len(row["finish"]) == len(row["total"])):
            return None
        return JudgedBatch(step, list(row["texts"]), list(row["finish"]), list(row["total"]), dict(row.get("metrics", {})))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def read_journal(path: Path, fp: str) -> tuple[list[JudgedBatch], str | None]:
    """The journaled batches of `path` (steps 1..k) and a note for the console (None: nothing to say).

    Reads only; `open_journal` truncates what was not kept."""
    if not path.is_file():
        return [], None
    raw = path.read_bytes()
    lines = raw.splitlines(keepends=True)
    try:
        header = json.loads(lines[0]) if lines and lines[0].endswith(b"\n") else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("journal") != VERSION or header.get("fingerprint") != fp:
        return [], f"{path}: journal of another config or other prompts (or a torn header); judging from the start"
    batches: list[JudgedBatch] = []
    for line in lines[1:]:
        b = _parse(line, len(batches) + 1)
        if b is None:
            break
        batches.append(b)
    dropped = len(lines) - 1 - len(batches)
    note = f"{path}: {len(batches)} judged batch(es) journaled"
    if dropped:
        note += f"; dropped {dropped} torn or unreadable line(s) after them"
    return batches, note


class Journal:
    """Appends one judged batch per line, durably (see the module docstring)."""

    def __init__(self, path: Path, stage: str, fp: str, keep: int):
        """Open `path` for appending after its header and first `keep` batches (what `read_journal`
        returned); everything after them is truncated away, a fresh header written if keep == 0."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if keep == 0:
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"journal": VERSION, "stage": stage, "fingerprint": fp}) + "\n")
            os.replace(tmp, path)
        else:
            lines = path.read_bytes().splitlines(keepends=True)
            with path.open("r+b") as f:
                f.truncate(sum(len(line) for line in lines[: keep + 1]))  # header + the kept batches
                f.flush()
                os.fsync(f.fileno())
        self._f = path.open("ab")

    def append(self, batch: JudgedBatch) -> None:
        """One line, flushed and fsynced: a disk sync per batch (~ms), small next to generating and judging it."""
        self._f.write((json.dumps(batch.as_json(), default=float) + "\n").encode())
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()
