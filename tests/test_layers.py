"""The package layers of docs/architecture.md hold: `lint-imports` (import-linter, contracts in
pyproject.toml) keeps them, every package is in a layer, and no library module is in an import cycle."""

import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

import posttrain

ROOT = Path(posttrain.__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _contracts() -> list[dict]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_lint_imports_keeps_every_contract():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # analyse this checkout's posttrain, not an installed one
    run = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"lint-imports found broken contracts:\n{run.stdout}\n{run.stderr}"
    assert "0 broken" in run.stdout


def test_every_package_is_placed_in_a_layer():
    layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
    named = {part.strip().strip("()") for layer in layers for part in layer.split("|")}
    present = {f"posttrain.{p.name}" for p in (ROOT / "posttrain").iterdir() if (p / "__init__.py").is_file()}
    present |= {f"posttrain.{p.stem}" for p in (ROOT / "posttrain").glob("*.py") if p.stem != "__init__"}
    assert present - named == set(), "a package outside the layers contract (add it in pyproject.toml)"


def test_no_library_module_is_in_an_import_cycle():
    # every import counts, those inside functions too: a cycle broken by a late import is still a cycle
    g = grimp.build_graph("posttrain", cache_dir=None)
    edges = {m: g.find_modules_directly_imported_by(m) for m in g.modules}
    cycles = []
    for start in edges:  # a module is in a cycle when it can reach itself (the graph has ~100 modules)
        seen, todo = set(), list(edges[start])
        while todo:
            m = todo.pop()
            if m == start:
                cycles.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo.extend(edges[m])
    assert cycles == []
