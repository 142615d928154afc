"""What a run folder holds before a run writes into it, and what resume may trust.

`inspect_run_dir` only reads: it compares the recipe with the folder's `recipe.yaml` (a different
recipe is refused, naming the first differing key), verifies every published checkpoint against its
manifest, and decides — resume, start over, or refuse. `prepare_run_dir` then does the writes: it sets
the checkpoints that failed verification aside (one line each), clears a folder that is started over,
and drops the metric, phase and eval rows a killed run logged after the checkpoints it continues from.

The cases (docs/run_dir.md):
- `--resume` on a folder that does not exist yet or is empty (killed in its first second): the run starts.
- `--resume` on a folder with our `recipe.yaml` and no published checkpoint (killed before the base
  checkpoint was published): the same recipe starts over cleanly; a different one is refused.
- `--resume` with checkpoints: every checkpoint that fails verification is set aside; each stage
  continues from its newest checkpoint that verifies (or restarts from the previous stage's final,
  which bitwise reproduces what it had done); when no checkpoint of the run verifies, it stops.
- a plain run into a folder that holds a run is refused (naming the differing key, if any).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from posttrain.runtime.checkpoint import (
    FINAL, CheckpointError, Fault, checkpoint_folders, final_checkpoint, latest_checkpoint, set_aside,
    verify_checkpoint,
)
from posttrain.runtime.config import Recipe
from posttrain.runtime.recipe_file import dump_recipe

RECIPE_FILE = "recipe.yaml"
RECIPE_TMP = f".{RECIPE_FILE}.tmp"
BASE = "base"  # checkpoints/base: the initial model (built from scratch or loaded)


class RunError(ValueError):
    """A run that cannot start (existing folder, nothing to resume, a different recipe)."""


@dataclass
class ResumePlan:
    """What `prepare_run_dir` will do to the folder, decided before anything is written."""

    resume: bool = False  # there are verified checkpoints to continue from
    clear: bool = False  # remove the folder's contents first (fresh, or a resume with nothing published)
    keep_recipe: bool = False  # while clearing, leave recipe.yaml (it is this recipe) until it is rewritten
    note: str | None = None  # one line to print (why the run starts over)
    bad: dict[Path, list[Fault]] = field(default_factory=dict)  # checkpoints that failed verification
    base: Path | None = None  # the verified base checkpoint a resume reuses (None: build or load it again)


def first_difference(old: Any, new: Any, path: str = "") -> str | None:
    """The first key path where two plain (YAML) values differ, with both values, or None.

    >>> first_difference({"a": 1, "s": [{"steps": 8}]}, {"a": 1, "s": [{"steps": 10}]})
    's.0.steps (folder: 8, now: 10)'"""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in list(new) + [k for k in old if k not in new]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in old:
                return f"{sub} (not in the folder's recipe, now: {new[key]!r})"
            if key not in new:
                return f"{sub} (folder: {old[key]!r}, not in this recipe)"
            found = first_difference(old[key], new[key], sub)
            if found:
                return found
        return None
    if isinstance(old, list) and isinstance(new, list):
        for i, (a, b) in enumerate(zip(old, new)):
            found = first_difference(a, b, f"{path}.{i}" if path else str(i))
            if found:
                return found
        if len(old) != len(new):
            return f"{path} (folder: {len(old)} entries, now: {len(new)})"
        return None
    return None if old == new else f"{path} (folder: {old!r}, now: {new!r})"


def check_same_recipe(run_dir: Path, recipe: Recipe) -> None:
    """Refuse a recipe that differs from the one the folder was run with, naming the first differing key."""
    path = run_dir / RECIPE_FILE
    try:
        old = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise RunError(f"{path}: unreadable ({type(e).__name__}); this folder's recipe cannot be compared with yours") from None
    new = yaml.safe_load(dump_recipe(recipe))
    for d in (old, new):  # how the ranks share the work is placement, not what is trained: a run may resume under
        if isinstance(d, dict):  # another data-parallel strategy, as at another world size (docs/distributed.md)
            d.pop("distributed", None)
    diff = first_difference(old, new)
    if diff:
        raise RunError(f"{path}: this folder was run with a different recipe, first at {diff}; "
                       f"undo the change, or run into a new --out folder")


def inspect_run_dir(run_dir: Path, recipe: Recipe, *, resume: bool, fresh: bool) -> ResumePlan:
    """Decide what to do with `run_dir`, reading only. Raises RunError (a folder that holds another run,
    a different recipe) or CheckpointError (checkpoints, none of which verifies)."""
    # our own half-written recipe (a kill between mkdir and the rename) does not make a folder a run
    holds_something = run_dir.is_dir() and any(p.name != RECIPE_TMP for p in run_dir.iterdir())
    if not resume:
        if holds_something and not fresh:
            if (run_dir / RECIPE_FILE).is_file():
                check_same_recipe(run_dir, recipe)
            raise RunError(f"{run_dir}: already holds a run; pass --resume to continue it or --out for a new folder")
        return ResumePlan(clear=holds_something)
    if not holds_something:
        return ResumePlan(note=f"{run_dir}: nothing to resume yet (the run stopped before writing anything); starting it")
    if not (run_dir / RECIPE_FILE).is_file():
        if checkpoint_folders(run_dir):
            raise RunError(f"{run_dir}: --resume, but the folder has checkpoints and no {RECIPE_FILE}; not a folder posttrain wrote")
        raise RunError(f"{run_dir}: --resume, but the folder holds neither a {RECIPE_FILE} nor a checkpoint; not a posttrain run folder")
    check_same_recipe(run_dir, recipe)
    folders = checkpoint_folders(run_dir)
    if not folders:
        return ResumePlan(clear=True, keep_recipe=True,
                          note=f"{run_dir}: the run stopped before its first checkpoint was published; "
                               f"starting it over (same recipe)")
    bad = {f: faults for f in folders if (faults := verify_checkpoint(f))}
    if len(bad) == len(folders):
        newest = max(bad, key=lambda p: p.stat().st_mtime)
        raise CheckpointError(f"{run_dir}: none of its {len(folders)} checkpoints verifies (e.g. "
                              f"{newest.relative_to(run_dir)}: {bad[newest][0]}); nothing to resume from — "
                              f"start the run again in a new folder")
    base = run_dir / "checkpoints" / BASE / FINAL
    return ResumePlan(resume=True, bad=bad, base=base if base in folders and base not in bad else None)


def fault_line(run_dir: Path, folder: Path, faults: list[Fault], moved: Path) -> str:
    more = f" (and {len(faults) - 1} more)" if len(faults) > 1 else ""
    return (f"{folder.relative_to(run_dir)}: {faults[0]}{more} — set aside as {moved.name}; "
            f"continuing from the newest checkpoint that verifies")


def prepare_run_dir(run_dir: Path, plan: ResumePlan, recipe: Recipe, console: Console) -> None:
    """Carry out `plan`: set aside what failed verification, clear or create the folder, write the recipe,
    and drop the rows logged after the checkpoints each unfinished stage continues from."""
    if plan.note:
        console.print(f"[yellow]{plan.note}")
    if plan.clear and not plan.keep_recipe:
        shutil.rmtree(run_dir)
    elif plan.clear:  # recipe.yaml goes last (it is rewritten below): a kill while clearing leaves a folder
        for p in run_dir.iterdir():  # that still reads as this run, and --resume clears it again
            if p.name == RECIPE_FILE:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    for folder, faults in plan.bad.items():
        console.print(f"[bold yellow]{fault_line(run_dir, folder, faults, set_aside(folder))}", highlight=False, soft_wrap=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / RECIPE_TMP
    tmp.write_text(dump_recipe(recipe))
    os.replace(tmp, run_dir / RECIPE_FILE)  # a kill never leaves half a recipe
    if plan.resume:
        drop_rows_after_checkpoints(run_dir, recipe)


def drop_rows_after_checkpoints(run_dir: Path, recipe: Recipe) -> None:
    """Each unfinished stage continues from its newest step checkpoint (or from scratch): what the killed
    run logged for it after that step is dropped, and its eval rows, so every stream reads as one run."""
    resumed_at: dict[str, int] = {}
    for s in recipe.stages:
        stage_dir = run_dir / "checkpoints" / s.folder
        if final_checkpoint(stage_dir) is None:
            ckpt = latest_checkpoint(stage_dir)
            resumed_at[s.folder] = int(ckpt.name.split("-")[1]) if ckpt else 0

    def keep(r: dict) -> bool:
        return r.get("stage") not in resumed_at or r.get("step", 0) <= resumed_at[r["stage"]]

    truncate_after(run_dir / "metrics.jsonl", keep)
    truncate_after(run_dir / "phases.jsonl", keep)
    truncate_after(run_dir / "evals.jsonl", lambda r: r.get("stage") not in resumed_at)


def truncate_after(path: Path, keep: Callable[[dict], bool]) -> None:
    """Rewrite a JSONL file keeping only records for which `keep` holds (atomic replace)."""
    if not path.exists():
        return
    lines = []
    for line in path.read_text().splitlines():
        try:
            if keep(json.loads(line)):
                lines.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
