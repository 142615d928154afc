"""The `posttrain` command line. Thin: parse, call the library, print; errors become one line + exit 2."""

from __future__ import annotations

import importlib

import os
import sys
from collections.abc import Callable
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="LLM post-training from one YAML recipe, measured on the roofline.")
console = Console()
T = TypeVar("T")


class Launcher(StrEnum):
    """Who starts the ranks of `posttrain run --nproc N`."""

    torchrun = "torchrun"
    ray = "ray"

DOCTOR_STOP_EXIT = 3  # the live doctor stopped the run (doctor.stop_on); 2 = a user error, 1 = a crash


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _guard(fn: Callable[[], T]) -> T:
    """Run `fn`; a user error (bad recipe, data, checkpoint, model folder) is one red line and exit 2."""
    from posttrain.data import DataError
    from posttrain.distributed import DistributedError
    from posttrain.models import ModelLoadError
    from posttrain.models.lora import LoraError
    from posttrain.runtime.checkpoint import CheckpointError
    from posttrain.runtime.config import RecipeError
    from posttrain.pipeline.run import RunError
    from posttrain.report import ReportError
    from posttrain.stages._training import NonFiniteError
    from posttrain.tasks import TaskError

    try:
        return fn()
    except (RecipeError, DataError, CheckpointError, RunError, ModelLoadError, LoraError, ReportError, TaskError,
            NonFiniteError, DistributedError) as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def packaged_recipe(name: str) -> Path:
    return Path(str(resources.files("posttrain") / "recipes" / f"{name}.yaml"))


def _run(recipe_path: Path, out: Path | None, resume: bool, overrides: list[str], *, fresh: bool) -> None:
    _quiet_libraries()
    from posttrain.distributed import init_world
    from posttrain.runtime.recipe_file import load_recipe
    from posttrain.pipeline.run import run_pipeline

    from posttrain.doctor import DoctorStop

    recipe = _guard(lambda: load_recipe(recipe_path, overrides))
    run_dir = out or Path("runs") / recipe.name
    ranks = _guard(lambda: init_world(recipe.device))  # under torchrun: join the other ranks (docs/distributed.md)
    # rank 0 speaks for the run; the other ranks print nothing but their errors
    said = console if ranks.is_main else Console(quiet=True)
    said.print(f"[bold]posttrain[/] {recipe_path} → {run_dir}"
               + (f" on {ranks.world_size} ranks ({ranks.backend})" if ranks.world_size > 1 else ""))
    clean = False
    try:
        _guard(lambda: run_pipeline(recipe, run_dir, resume=resume, fresh=fresh, console=said, ranks=ranks))
        clean = True
    except DoctorStop as stop:  # the recipe asked the doctor to stop at this severity: one line, exit 3
        _finish(run_dir)
        console.print(f"[bold red]stopped:[/] {stop} (doctor.json: `stopped`; doctor.stop_on in the recipe)",
                      highlight=False, soft_wrap=True)
        raise typer.Exit(DOCTOR_STOP_EXIT) from None
    finally:
        ranks.close(clean=clean)
    if ranks.is_main:  # the report is written once, by the rank that wrote the run folder
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
    nproc: Annotated[int, typer.Option(min=1, help="data-parallel ranks on this machine: launches torchrun (torch.distributed.run) with the same arguments (docs/distributed.md); 1 = a plain run")] = 1,
    launcher: Annotated[Launcher, typer.Option(help="who starts the --nproc ranks: torchrun (this machine), or ray (Ray actors on the Ray cluster; docs/placement.md)")] = Launcher.torchrun,
) -> None:
    """Run a recipe."""
    if launcher is Launcher.ray and "WORLD_SIZE" not in os.environ:
        _launch_ray_learners(nproc, recipe, overrides or [])
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        _launch_ranks(nproc, recipe, overrides or [])
    if "WORLD_SIZE" in os.environ and nproc > 1 and int(os.environ["WORLD_SIZE"]) != nproc:
        console.print(f"[bold red]error:[/] --nproc {nproc}, but this process is one of WORLD_SIZE={os.environ['WORLD_SIZE']} "
                      f"ranks already (started by torchrun); drop --nproc or torchrun")
        raise typer.Exit(2)
    _run(recipe, out, resume, overrides or [], fresh=False)


def _rank_entry(argv: list[str]) -> int | None:
    """What each learner rank of `--launcher ray` runs, in its Ray actor: `posttrain run ARGV` (the
    actor has set RANK, WORLD_SIZE, … as torchrun would); its exit status."""
    return app(args=["run", *argv], prog_name="posttrain", standalone_mode=False)


def _launch_ray_learners(nproc: int, recipe: Path, overrides: list[str]) -> None:
    """`posttrain run --launcher ray --nproc N …`: check the recipe here, then run the same command on N
    Ray actors forming one torch.distributed group (posttrain/distributed/ray_learners.py); rank 0's
    output is printed here; a failed rank stops the others and is one line naming it, exit 1."""
    from posttrain.distributed.ray_learners import LearnerError, LearnerGroup, check_rollout_placement, launch_learners
    from posttrain.pipeline.run import check_data_parallel
    from posttrain.runtime.recipe_file import load_recipe

    loaded = _guard(lambda: load_recipe(recipe, overrides))
    _guard(lambda: check_data_parallel(loaded, nproc))
    placed = loaded.placement
    try:
        check_rollout_placement(nproc, placed.rollout_workers if placed else None,
                                [(s.stage, s.folder) for s in loaded.stages])
    except LearnerError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    group = LearnerGroup(nproc, num_cpus=placed.num_cpus_per_learner if placed else 1.0,
                         num_gpus=1.0 if loaded.device.startswith("cuda") else 0.0)
    # by reference, from its module: under `python -m posttrain.cli` this module is __main__, which Ray would
    # pickle by value — so the function is taken from the module `posttrain.cli` (imported by name: this file
    # reaching itself, not an import of another module)
    rank_entry = importlib.import_module("posttrain.cli")._rank_entry

    args = _args_without(("--nproc", "--launcher"))
    console.print(f"[dim]launching {nproc} learner ranks as Ray actors ({group.num_cpus:g} CPUs each): posttrain run "
                  f"{' '.join(args)}")
    try:
        launch_learners(group, rank_entry, args, print_fn=lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    except LearnerError as e:
        from rich.markup import escape  # the message quotes a rank's output, which may hold [brackets]

        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    raise typer.Exit(0)


def _args_without(options: tuple[str, ...]) -> list[str]:
    """This command's arguments after `run`, without `options` and their values."""
    args = sys.argv[sys.argv.index("run") + 1 :] if "run" in sys.argv else []
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not any(a.startswith(o + "=") for o in options):
            kept.append(a)
    return kept


def _launch_ranks(nproc: int, recipe: Path, overrides: list[str]) -> None:
    """`posttrain run --nproc N …`: check the recipe here (a bad one is one line, before any rank starts),
    then replace this process by `torchrun --standalone --nproc-per-node N -m posttrain.cli run …` with the
    other arguments as given; torchrun's exit status is the command's."""
    from posttrain.pipeline.run import check_data_parallel
    from posttrain.runtime.recipe_file import load_recipe

    loaded = _guard(lambda: load_recipe(recipe, overrides))
    _guard(lambda: check_data_parallel(loaded, nproc))
    args = sys.argv[sys.argv.index("run") + 1 :] if "run" in sys.argv else []
    kept, skip = [], False
    for a in args:  # the same arguments, without --nproc (each rank is one process of the N)
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            kept.append(a)
    console.print(f"[dim]launching {nproc} ranks: torchrun --standalone --nproc-per-node {nproc} -m posttrain.cli run "
                  f"{' '.join(kept)}")
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                              str(nproc), "-m", "posttrain.cli", "run", *kept])


@app.command("eval")
def eval_(
    checkpoint: Annotated[str, typer.Argument(help="an HF checkpoint folder (ours or not), or a named one: smollm2-135m-instruct")],
    task: Annotated[str | None, typer.Option(help="a built-in task: arithmetic, arithmetic-tools, code, code-tools, humaneval")] = None,
    path: Annotated[Path | None, typer.Option(help="a `problem` JSONL file (docs/data.md) instead of --task")] = None,
    verifier: Annotated[str | None, typer.Option(help="the verifier that judges replies to --path (math, code, …)")] = None,
    k: Annotated[list[int] | None, typer.Option(help="sampled pass@k, repeatable: --k 1 --k 10")] = None,
    samples: Annotated[int | None, typer.Option(help="samples per problem for pass@k (default max k)")] = None,
    temperature: Annotated[float, typer.Option(help="sampling temperature of the pass@k samples")] = 1.0,
    levels: Annotated[list[str] | None, typer.Option(help="levels to evaluate, repeatable (default: all)")] = None,
    per_level: Annotated[int | None, typer.Option(help="problems per level (or in all, for a task without levels)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="answer budget")] = 48,
    batch_size: Annotated[int, typer.Option(help="prompts per generation batch")] = 32,
    greedy: Annotated[bool, typer.Option(help="greedy pass@1 per level")] = True,
    threads: Annotated[int | None, typer.Option(help="torch intra-op threads")] = None,
    out: Annotated[Path | None, typer.Option(help="write the rows as JSONL (EvalRecord, docs/run_dir.md)")] = None,
) -> None:
    """Evaluate a checkpoint on one task or problem file: greedy and sampled pass@k, per level, with standard errors."""
    _quiet_libraries()
    import json

    from pydantic import ValidationError

    from posttrain.pipeline.evals import as_json, eval_table, evaluate_checkpoint
    from posttrain.runtime.config import EvalSpec, RecipeError
    from posttrain.runtime.recipe_file import format_validation_error

    def spec() -> EvalSpec:
        fields = {"task": task, "path": path, "verifier": verifier, "k": k or [], "samples": samples,
                  "temperature": temperature, "levels": levels or None, "per_level": per_level,
                  "max_new_tokens": max_new_tokens, "batch_size": batch_size, "greedy": greedy}
        try:
            return EvalSpec.model_validate({key: v for key, v in fields.items() if v is not None})
        except ValidationError as e:
            raise RecipeError(format_validation_error(e, "posttrain eval")) from None

    chosen = _guard(spec)
    records = _guard(lambda: evaluate_checkpoint(checkpoint, chosen, threads=threads))
    console.print(eval_table(records))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in as_json(records)))
        console.print(f"wrote {len(records)} rows to {out}")


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="a run folder")]) -> None:
    """Write RUN_DIR/report.html (self-contained) and print the run's summary."""
    _quiet_libraries()
    _finish(run_dir)


@app.command()
def bisect(run_dir: Annotated[Path, typer.Argument(help="a run folder")]) -> None:
    """Evals on every checkpoint in pipeline order; moves beyond 2 standard errors marked; the first checkpoint where each dropped."""
    from rich.table import Table

    from posttrain.report import bisect_table, eval_table, load_run
    from posttrain.report.charts import eval_row_label

    if not (run_dir / "evals.jsonl").is_file():
        what = "does not exist" if not run_dir.is_dir() else "has no evals.jsonl (did the recipe name `evals`?)"
        console.print(f"[bold red]error:[/] {run_dir}: {what}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    try:  # ReportError (a bad line) or ValueError (a row missing stage/eval/metric/value): a user error
        evals = eval_table(load_run(run_dir))
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    tracks, columns = bisect_table(evals), evals.columns
    table = Table(title=f"evals of {run_dir} across the pipeline (Δ in points; ▲/▼ beyond 2 standard errors)")
    table.add_column("eval")
    for c in columns:
        table.add_column(c, justify="right")
    table.add_column("first drop")
    for t in tracks:
        moves = {m.after: m for m in t.moves}
        cells = []
        for c in columns:
            if c not in t.values:  # this checkpoint has no such row
                cells.append("")
                continue
            v, m = t.values[c], moves.get(c)
            text = "—" if v is None else f"{100 * v:.1f}%"
            if m is not None:
                mark = {"up": " [green]▲[/]", "down": " [red]▼[/]"}.get(m.verdict, "")
                text += f" ({100 * m.delta:+.1f}){mark}"
            cells.append(text)
        table.add_row(eval_row_label(t.row), *cells, f"[red]{t.first_drop}[/]" if t.first_drop else "—")
    console.print(table)


@app.command()
def doctor(run_dir: Annotated[Path, typer.Argument(help="a run folder")]) -> None:
    """Diagnose a run folder's streams: write RUN_DIR/doctor.json and print the findings."""
    from posttrain.doctor import write_doctor_json

    if not (run_dir / "metrics.jsonl").is_file():
        console.print(f"[bold red]error:[/] {run_dir}: no metrics.jsonl here (is it a run folder?)", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    path, findings = write_doctor_json(run_dir)
    for f in findings:
        console.print(f.plain(), highlight=False, markup=False, soft_wrap=True)
    counts = {s: sum(f.severity.value == s for f in findings) for s in ("critical", "warning", "info")}
    console.print(f"doctor: {counts['critical']} critical, {counts['warning']} warning, {counts['info']} info → {path}")


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
def chat(
    checkpoint: Annotated[Path, typer.Argument(help="an HF chat-model folder (ours or any other)")],
    system: Annotated[str | None, typer.Option(help="system prompt (default: the template's own, if any)")] = None,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy")] = 0.7,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="longest reply, in tokens")] = 256,
    seed: Annotated[int | None, typer.Option(help="sampling seed (default: unseeded)")] = None,
) -> None:
    """Talk to CHECKPOINT in the terminal with its own chat template (/reset, /exit; end of input ends it)."""
    _quiet_libraries()
    from posttrain.chat import chat_loop, open_session

    session = _guard(lambda: open_session(checkpoint, system=system, temperature=temperature,
                                          max_new_tokens=max_new_tokens, seed=seed))
    chat_loop(session, console)


@app.command()
def verify(run_dir: Annotated[Path, typer.Argument(help="a run folder")]) -> None:
    """Check every checkpoint of RUN_DIR against its manifest (sizes and SHA-256 hashes); exit 2 on any failure."""
    from rich.table import Table

    from posttrain.runtime.checkpoint import verify_run

    if not (run_dir / "checkpoints").is_dir():
        console.print(f"[bold red]error:[/] {run_dir}: no checkpoints/ folder; not a run folder", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    rows = verify_run(run_dir)
    table = Table("checkpoint", "files", "MB", "status", title=f"checkpoints of {run_dir}")
    for v in rows:
        status = "[green]ok" if not v.faults else "[red]" + "; ".join(str(f) for f in v.faults)
        table.add_row(str(v.folder.relative_to(run_dir)), str(v.files), f"{v.bytes / 1e6:,.1f}", status)
    console.print(table)
    failed = sum(bool(v.faults) for v in rows)
    if not rows or failed:
        what = "no published checkpoint" if not rows else f"{failed} of {len(rows)} checkpoints fail verification"
        console.print(f"[bold red]error:[/] {run_dir}: {what}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    console.print(f"all {len(rows)} checkpoints verify")


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
