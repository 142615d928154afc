"""The `posttrain` command line. Thin: parse, call the library, print; errors become one line + exit 2."""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="LLM post-training from one YAML recipe, measured on the roofline.")
console = Console()
T = TypeVar("T")


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _guard(fn: Callable[[], T]) -> T:
    """Run `fn`; a user error (bad recipe, data, checkpoint, model folder) is one red line and exit 2."""
    from posttrain.data import DataError
    from posttrain.models import ModelLoadError
    from posttrain.models.lora import LoraError
    from posttrain.runtime.checkpoint import CheckpointError
    from posttrain.runtime.config import RecipeError
    from posttrain.pipeline.run import RunError
    from posttrain.report import ReportError

    try:
        return fn()
    except (RecipeError, DataError, CheckpointError, RunError, ModelLoadError, LoraError, ReportError) as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def packaged_recipe(name: str) -> Path:
    return Path(str(resources.files("posttrain") / "recipes" / f"{name}.yaml"))


def _run(recipe_path: Path, out: Path | None, resume: bool, overrides: list[str], *, fresh: bool) -> None:
    _quiet_libraries()
    from posttrain.runtime.config import load_recipe
    from posttrain.pipeline.run import run_pipeline

    recipe = _guard(lambda: load_recipe(recipe_path, overrides))
    run_dir = out or Path("runs") / recipe.name
    console.print(f"[bold]posttrain[/] {recipe_path} → {run_dir}")
    _guard(lambda: run_pipeline(recipe, run_dir, resume=resume, fresh=fresh, console=console))
    _finish(run_dir)


def _finish(run_dir: Path) -> None:
    """Every run ends with the report and the terminal summary."""
    from posttrain.report import summary_renderable, write_report

    path = _guard(lambda: write_report(run_dir))
    console.print(_guard(lambda: summary_renderable(run_dir)))
    console.print(f"run folder: {run_dir}    report: {path}")


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="run folder")] = Path("runs/demo"),
    resume: Annotated[bool, typer.Option(help="continue an interrupted demo")] = False,
) -> None:
    """Train a tiny model from scratch on the arithmetic world and take it through the pipeline."""
    _run(packaged_recipe("quickstart"), out, resume, [], fresh=not resume)


@app.command()
def run(
    recipe: Annotated[Path, typer.Argument(help="recipe YAML")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides, e.g. stages.1.steps=50")] = None,
    out: Annotated[Path | None, typer.Option(help="run folder (default runs/<recipe name>)")] = None,
    resume: Annotated[bool, typer.Option(help="continue the run in --out from its newest checkpoint")] = False,
) -> None:
    """Run a recipe."""
    _run(recipe, out, resume, overrides or [], fresh=False)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="a run folder")]) -> None:
    """Write RUN_DIR/report.html (self-contained) and print the run's summary."""
    _quiet_libraries()
    _finish(run_dir)


@app.command()
def roofline(measure: Annotated[bool, typer.Option(help="measure this machine's peaks (CPU) instead of the cached/table values")] = False) -> None:
    """Print the device and its roofs."""
    from posttrain.telemetry.cli import roofline_command

    roofline_command(measure)


@app.command()
def phases(run_dir: Annotated[Path, typer.Argument(help="a run folder")]) -> None:
    """Per-phase table of a run: time share, GFLOP/s, GB/s, intensity, % of roof, verdict, busy; the cycle gap."""
    from posttrain.telemetry.cli import phases_command

    try:
        phases_command(run_dir)
    except FileNotFoundError as e:  # no run folder / no phases.jsonl: a user error, not a crash
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Argument(help="a checkpoint folder (full weights or a LoRA adapter)")],
    merge: Annotated[Path | None, typer.Option(help="write a plain HF folder here with every LoRA adapter merged")] = None,
) -> None:
    """Write CHECKPOINT as a plain Hugging Face folder (adapters merged) that `transformers` loads without PEFT."""
    _quiet_libraries()
    if merge is None:
        console.print("[bold red]error:[/] export: give --merge OUT (the folder to write)", highlight=False)
        raise typer.Exit(2)
    from posttrain.models.export import export_merged

    out = _guard(lambda: export_merged(checkpoint, merge))
    console.print(f"exported {checkpoint} → {out}")


if __name__ == "__main__":
    app()
