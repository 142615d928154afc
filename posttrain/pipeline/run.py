"""Run a recipe: validate everything first, then the stages in order, evals between them, resume.

Nothing is written before the recipe and every data file it names have been validated, so bad input
never leaves a half-made run directory. The pipeline owns resume (pipeline/resume.py): every checkpoint
is verified against its manifest first and one that fails is set aside; a stage with a `final/`
checkpoint is done and skipped; a stage with step checkpoints continues from the newest; metrics logged
after that checkpoint by the killed run are dropped so the streams read as one uninterrupted run.

Data-parallel (`torchrun --nproc-per-node N -m posttrain.cli run …`, docs/distributed.md): rank 0 alone
writes the run folder — recipe, base checkpoint, checkpoints, metrics, phases, evals, doctor.json; the
other ranks wait for it at each hand-off (base published, each checkpoint published) and then read
what it wrote. A stage that does not run data-parallel is refused before anything is written.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from posttrain.data import encode_sft_dataset, read_jsonl
from posttrain.distributed import World
from posttrain.doctor import DoctorStop, LiveDoctor, Severity, load_streams, write_doctor_json
from posttrain.doctor.diagnose import RUN_RULES
from posttrain.models import NAMED_CHECKPOINTS, build_tiny, checkpoint_folder, count_parameters, load_model, load_tokenizer, train_tokenizer
from posttrain.models.cpu_math import use_threads
from posttrain.models.tiny import PRESETS
from posttrain.rollout.engine import backend_unavailable_reason
from posttrain.runtime.allocator import set_mmap_threshold
from posttrain.runtime.checkpoint import FINAL, final_checkpoint, publish
from posttrain.runtime.config import Recipe, task_names
from posttrain.runtime.context import RunContext, StageResult, eval_plan, make_tasks
from posttrain.pipeline.evals import append_evals, record_from_json, run_evals
from posttrain.pipeline.resume import BASE, RunError, inspect_run_dir, prepare_run_dir
from posttrain.tasks import Capability, TaskSet
from posttrain.tasks.base import RECORD_KINDS
from posttrain.tasks.records import EvalRecord
from posttrain.stages.pretrain import run_pretrain
from posttrain.stages import (
    dpo as dpo_stage,
    grpo as grpo_stage,
    ppo as ppo_stage,
    reward_model as reward_model_stage,
    sft as sft_stage,
)
from posttrain.stages.sft import run_sft
from posttrain.stages.reward_model import run_reward_model
from posttrain.stages.dpo import run_dpo
from posttrain.stages.ppo import run_ppo
from posttrain.stages.grpo import run_grpo
from posttrain.stages.rejection_sampling import check_teachers, produced_paths, run_rejection_sampling
from posttrain.stages._constitution import produced_paths as constitution_outputs
from posttrain.stages.constitutional_rl import run_constitutional_rl
from posttrain.stages.constitutional_sl import run_constitutional_sl
from posttrain.telemetry import JsonlSink, MetricSink, Telemetry
from posttrain.telemetry.devices import slow_bf16_reason
from posttrain.telemetry.ranks import RankTelemetry
from posttrain.telemetry.revision import Announcer

STAGES: dict[str, Callable[..., StageResult]] = {"pretrain": run_pretrain, "sft": run_sft, "grpo": run_grpo,
                                                 "rejection_sampling": run_rejection_sampling,
                                                 "reward_model": run_reward_model, "dpo": run_dpo, "ppo": run_ppo,
                                                 "constitutional_sl": run_constitutional_sl,
                                                 "constitutional_rl": run_constitutional_rl}
# The stages that run data-parallel, each with why a config of it cannot (None: it can).
DATA_PARALLEL: dict[str, Callable[..., str | None]] = {"sft": sft_stage.data_parallel_problem,
                                                       "grpo": grpo_stage.data_parallel_problem,
                                                       "dpo": dpo_stage.data_parallel_problem,
                                                       "reward_model": reward_model_stage.data_parallel_problem,
                                                       "ppo": ppo_stage.data_parallel_problem}
# The stages that also run with `distributed.strategy: fsdp` (FSDP2; docs/distributed.md).
SHARDABLE = ("sft", "grpo")
__all__ = ["BASE", "DATA_PARALLEL", "RunError", "STAGES", "run_pipeline"]


class NullSink:
    """The metric sink of ranks other than 0: they log nothing (rank 0 logs the global values)."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def check_data_parallel(recipe: Recipe, world_size: int) -> None:
    """On more than one rank every stage must run data-parallel: refused before anything is written,
    naming the stage, rather than N processes each training a copy."""
    if world_size == 1:
        return
    for i, stage in enumerate(recipe.stages):
        check = DATA_PARALLEL.get(stage.stage)
        problem = (f"the {stage.stage} stage does not run data-parallel yet (data-parallel: "
                   f"{', '.join(DATA_PARALLEL)}); run this recipe in one process") if check is None else check(stage, world_size)
        if not problem and recipe.distributed.strategy == "fsdp":
            if stage.stage not in SHARDABLE:
                problem = (f"the {stage.stage} stage does not run with distributed.strategy fsdp yet (fsdp: "
                           f"{', '.join(SHARDABLE)}); use strategy: replicate")
            elif recipe.model.lora is not None:
                problem = "distributed.strategy fsdp with model.lora is not supported; use strategy: replicate"
        if problem:
            raise RunError(f"stages[{i}] ({stage.folder}): {problem} — {world_size} ranks from torchrun")


def last_good_checkpoint(stage_dir: Path, first_step: int, fallback: Path) -> Path:
    """The newest checkpoint of a stopped stage saved before the step its failure began (else the
    stage's start): what the run should continue from once the cause is fixed."""
    steps = sorted(p for p in stage_dir.glob("step-*") if int(p.name.split("-")[1]) < first_step) if stage_dir.is_dir() else []
    return steps[-1] if steps else fallback


def stop_record(stop: DoctorStop, run_dir: Path, checkpoint: Path) -> dict:
    """doctor.json's `stopped`: which finding stopped the run, where, and what is kept."""
    f = stop.finding
    where = checkpoint.relative_to(run_dir) if checkpoint.is_relative_to(run_dir) else checkpoint
    return {"stage": f.stage, "rule": f.rule, "severity": f.severity.value, "first_step": f.first_step,
            "stopped_at_step": stop.at_step, "reason": f.summary, "last_good_checkpoint": str(where)}


def record_kind(stage) -> str:
    """The JSONL schema a stage's `data: [{path}]` files are read in (docs/data.md)."""
    if stage.stage == "dpo":
        return "unpaired" if stage.loss == "kto" else "preference"
    return {"sft": "sft", "reward_model": "preference", "ppo": "problem", "grpo": "problem",
            "rejection_sampling": "problem", "constitutional_sl": "problem", "constitutional_rl": "problem"}[stage.stage]


def validate_inputs(recipe: Recipe, tokenizer, run_dir: Path, tasks: TaskSet | None = None) -> None:
    """Read and encode every data file the recipe names, and check every data task supplies the
    records its stage reads, before anything is written.

    A file an earlier rejection-sampling or constitutional stage will write is accepted unread; one written by a later
    stage is an error. Raises DataError naming the file, the line and the field (or the over-long
    record)."""
    produced = {**produced_paths(recipe, run_dir), **constitution_outputs(recipe, run_dir)}
    try:
        check_teachers(recipe)
    except ValueError as e:
        raise RunError(str(e)) from None
    for e in recipe.evals:
        if e.path is not None:
            read_jsonl(e.path, "problem")
    for i, stage in enumerate(recipe.stages):
        env = getattr(stage, "env", None)
        if env is not None and env.name == "task" and tasks is not None:
            names = task_names(stage.data)
            if not any(tasks.get(n).has(Capability.ENV) for n in names):
                raise RunError(f"stages[{i}].env: name 'task', but none of the stage's data tasks {names} supplies an "
                               "environment (arithmetic-tools does); or name one, e.g. `env: {name: tools}`")
        for src in getattr(stage, "data", []):
            if src.path is None:
                task = tasks.get(src.task) if tasks is not None else None
                kind = record_kind(stage)
                if task is not None and not task.has(RECORD_KINDS[kind]):
                    raise RunError(f"stages[{i}].data: task {src.task!r} supplies no {kind} records "
                                   f"(it supplies: {', '.join(sorted(c.value for c in task.capabilities))})")
                continue
            writer = produced.get(src.path.resolve())
            if writer is not None:
                if writer >= i:
                    raise RunError(f"stages[{i}].data: {src.path} is written by stages[{writer}], which runs later")
                continue
            records = read_jsonl(src.path, record_kind(stage)).records
            if stage.stage == "sft" and stage.truncation == "error":
                encode_sft_dataset(records, tokenizer, stage.max_len, truncation="error")


def check_model_init(recipe: Recipe) -> None:
    init = recipe.model.init
    if init not in PRESETS and init not in NAMED_CHECKPOINTS and not (Path(init) / "config.json").is_file():
        raise RunError(f"model.init: {init!r} is neither a tiny preset {sorted(PRESETS)}, a named checkpoint "
                       f"{sorted(NAMED_CHECKPOINTS)}, nor a folder with a config.json")


def check_backends(recipe: Recipe) -> None:
    """Every stage's rollout backend can run here (vLLM: installed and a CUDA GPU), before anything starts."""
    for i, stage in enumerate(recipe.stages):
        backend = getattr(stage, "backend", None)
        reason = None if backend is None else backend_unavailable_reason(backend)
        if reason is not None:
            raise RunError(f"stages[{i}].backend: {backend!r}, but {reason}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_world(recipe: Recipe):
    """An arithmetic world as the recipe's `arithmetic` task would build it (it holds out at least the
    largest arithmetic eval's `per_level` problems per level) — for callers that pass it back in as
    `run_pipeline(world=…)` to read its `drawn` set afterwards."""
    from posttrain.worlds.arithmetic import ArithmeticWorld

    return ArithmeticWorld(seed=recipe.world_seed,
                           eval_per_level=max(ArithmeticWorld.eval_per_level, recipe.arithmetic_eval_per_level()))


def tokenizer_texts(tasks: TaskSet) -> list[str]:
    """What a from-scratch tokenizer is trained on: the texts of every recipe task that has some."""
    texts = [t for name in tasks.names if tasks.get(name).has(Capability.TOKENIZER) for t in tasks.get(name).tokenizer_texts()]
    if not texts:
        raise RunError(f"model.init: a tiny preset is built from scratch with a tokenizer trained on the recipe's task texts, "
                       f"but none of its tasks {tasks.names} has any (the `arithmetic` task does); or give a model folder")
    return texts


def make_base(recipe: Recipe, tasks: TaskSet, console: Console):
    """The initial (model, tokenizer), in memory: a tiny model with a tokenizer trained on the recipe's
    tasks, or the user's model folder (or a named built-in checkpoint)."""
    m = recipe.model
    if m.init in PRESETS:
        tok = train_tokenizer(tokenizer_texts(tasks), vocab_size=m.vocab_size)
        model = build_tiny(m.init, vocab_size=len(tok), seed=recipe.seed, arch=m.arch, max_seq_len=m.max_seq_len,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        console.print(f"base: {m.init} ({m.arch}) built from scratch, {count_parameters(model):,} parameters, vocabulary {len(tok)}")
        return model, tok
    folder = checkpoint_folder(m.init)
    tok, model = load_tokenizer(folder), load_model(folder)
    console.print(f"base: loaded {m.init}{'' if str(folder) == m.init else f' ({folder})'}, {count_parameters(model):,} parameters")
    return model, tok


def save_base(model, tok, run_dir: Path) -> Path:
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": 0, "stage": BASE, "final": True}))

    return publish(run_dir / "checkpoints" / BASE / "final", write)


def prepare_start(recipe: Recipe, run_dir: Path, tasks: TaskSet, console: Console, *, resume: bool, fresh: bool):
    """Check the folder and the inputs, then write what a run starts from: the folder set up for this
    run (or resumed) and the base checkpoint. Returns (the base checkpoint, its tokenizer)."""
    # Read-only first: the folder's recipe must be this one, and resume trusts only checkpoints that verify.
    plan = inspect_run_dir(run_dir, recipe, resume=resume, fresh=fresh)
    base_done = plan.base
    if base_done is not None:
        start, tokenizer = base_done, load_tokenizer(base_done)
    else:  # a new run, or a resume whose base checkpoint failed verification: built again, identically
        base_model, tokenizer = make_base(recipe, tasks, console)
    for name in tasks.names:
        console.print(f"[dim]{tasks.get(name).describe()}")
    validate_inputs(recipe, tokenizer, run_dir, tasks)  # before anything is written
    prepare_run_dir(run_dir, plan, recipe, console)  # set aside / clear, recipe.yaml, drop rows after checkpoints
    if base_done is None:
        start = save_base(base_model, tokenizer, run_dir)
        tokenizer = load_tokenizer(start)
    return start, tokenizer


def run_pipeline(recipe: Recipe, run_dir: Path, *, resume: bool = False, fresh: bool = False,
                 console: Console | None = None, world=None, ranks: World | None = None) -> list[EvalRecord]:
    """Run the recipe's stages into `run_dir`, evaluating after each; returns every eval record (on
    ranks other than 0: none).

    `world`: an ArithmeticWorld for the `arithmetic` task instead of building one (e.g. one whose
    `drawn` set the caller reads afterwards to check an eval set against everything the run trained
    on); used only if the recipe names that task. Tasks the recipe does not name are never built.
    `ranks`: this process's place in a data-parallel run (`distributed.init_world()`; default: one process)."""
    console = console or Console()
    ranks = ranks or World()
    check_model_init(recipe)
    check_backends(recipe)
    check_data_parallel(recipe, ranks.world_size)
    seed_everything(recipe.seed)
    use_threads(recipe.threads)  # before anything computes: a process's first parallel cos/sin is primed (models/cpu_math.py)
    tasks = make_tasks(recipe, world)
    evals_plan = eval_plan(recipe, tasks)
    if ranks.is_main:
        start, tokenizer = prepare_start(recipe, run_dir, tasks, console, resume=resume, fresh=fresh)
        if not evals_plan:
            console.print("[dim]evals: none (the recipe names no `evals`)")
    ranks.barrier()  # a sync point: rank 0 has prepared the folder and published the base checkpoint
    if not ranks.is_main:  # rank 0 checked the folder and the inputs; a failure there ends every rank (torchrun)
        start = run_dir / "checkpoints" / BASE / FINAL
        tokenizer = load_tokenizer(start)
    if recipe.mmap_threshold_mib is not None and (why := set_mmap_threshold(int(recipe.mmap_threshold_mib * 2**20),
                                                                               int(recipe.heap_keep_mib * 2**20))):
        console.print(f"[yellow]mmap_threshold_mib: not applied — {why}[/]")
    device = ranks.device(recipe.device)
    if recipe.dtype == "bf16" and ranks.is_main and (why := slow_bf16_reason(device)):
        console.print(f"[yellow]dtype: bf16 — {why}; dtype: fp32 trains faster on this machine[/]")

    t0 = time.perf_counter()
    tc = recipe.telemetry
    # ranks other than 0 time their phases in memory; rank 0 gathers them at each logged step (ctx.log)
    telemetry: Telemetry = Telemetry.disabled() if ranks.is_main else RankTelemetry(
        rank=ranks.rank, started=t0, device=device, dtype="bf16" if recipe.dtype == "bf16" else "fp32")
    sink: MetricSink = NullSink()
    if ranks.is_main:
        telemetry = Telemetry.open(run_dir, device=device, dtype=torch.bfloat16 if recipe.dtype == "bf16" else torch.float32,
                                   peak_flops=tc.peak_flops, peak_bytes_per_s=tc.peak_bytes_per_s,
                                   measure_cpu=tc.measure_cpu, busy_hz=tc.busy_hz, started=t0,
                                   on_revision=Announcer(lambda line: console.print(f"[yellow]{line}[/yellow]")))
        sink = JsonlSink(run_dir / "metrics.jsonl")
    evals_path = run_dir / "evals.jsonl"
    dc = recipe.doctor
    doctor = LiveDoctor(every=dc.every, stop_on=Severity(dc.stop_on) if dc.stop_on else None,
                        say=lambda text: console.print(text, style="yellow", highlight=False, markup=False, soft_wrap=True))
    stopped: dict | None = None

    def evaluate(stage: str, checkpoint: Path, steps: int, round_k: int | None = None) -> None:
        # Between-stage evals are decode work: each generation batch is an `eval` phase with its cost.
        if not evals_plan or not ranks.is_main:  # rank 0 alone evaluates (the ranks hold the same weights)
            return
        model = load_model(checkpoint, device=device)
        where = str(checkpoint.relative_to(run_dir))
        stage_records = run_evals(evals_plan, model, tokenizer, stage=stage, checkpoint=where,
                                  phase=lambda: telemetry.phase("eval", stage=stage, step=steps), round_k=round_k)
        append_evals(evals_path, stage_records)  # each row with its bisect mark against the previous checkpoint

    try:
        # A loaded model is evaluated before the first stage: the "before" of every gain the run reports
        # (a model built from scratch is random and is not).
        if evals_plan and recipe.model.init not in PRESETS and not any(r.stage == BASE for r in read_evals(evals_path)):
            evaluate(BASE, start, 0)
        for index, stage in enumerate(recipe.stages):
            ctx = RunContext(run_dir=run_dir, recipe=recipe, device=device, tokenizer=tokenizer, tasks=tasks,
                             telemetry=telemetry, sink=sink, start=start, console=console, t0=t0,
                             doctor=doctor if ranks.is_main else None, ranks=ranks)
            done = final_checkpoint(ctx.stage_dir(stage.folder))
            if done is not None:
                console.print(f"[dim]{stage.folder}: done, skipping")
                start = done
                continue
            console.rule(f"[bold]{stage.folder}")
            # Each stage starts from a known RNG state, so a stage re-run after a kill (before its first
            # checkpoint) sees what the uninterrupted run saw; a resumed stage restores its saved state.
            seed_everything(recipe.seed + 1000 * (index + 1))
            logged = [r for r in load_streams(run_dir).stages if r.name == stage.folder] if ranks.is_main else []
            doctor.begin(stage.folder, stage.stage, stage.model_dump(mode="json"), logged[0].records if logged else None)
            try:
                result = STAGES[stage.stage](stage, ctx)
            except DoctorStop as stop:
                stopped = stop_record(stop, run_dir, last_good_checkpoint(ctx.stage_dir(stage.folder), stop.finding.first_step, start))
                raise
            finally:
                doctor.end()
            start = result.checkpoint
            evaluate(stage.folder, start, stage.steps, stage.round)
            try:
                if ranks.is_main:
                    doctor.check_run([f for rule in RUN_RULES for f in rule(load_streams(run_dir)) if f.stage == stage.folder])
            except DoctorStop as stop:
                stopped = stop_record(stop, run_dir, start)
                raise
    finally:
        sink.close()
        telemetry.close()
        tasks.close()
        try:  # every run ends with doctor.json, a stopped or crashed one too (its streams are the evidence)
            if ranks.is_main:
                write_doctor_json(run_dir, cost=doctor.cost_json(), stopped=stopped or {}, live=list(doctor.seen.values()))
        except Exception as e:  # never mask the run's own outcome
            console.print(f"[yellow]doctor: could not write doctor.json: {type(e).__name__}: {e}")
    return read_evals(evals_path) if ranks.is_main else []


def read_evals(path: Path) -> list[EvalRecord]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(record_from_json(json.loads(line)))  # the bisect marks are not EvalRecord fields
        except (json.JSONDecodeError, TypeError):
            continue
    return out
