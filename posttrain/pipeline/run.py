"""Run a recipe: validate everything first, then the stages in order, evals between them, resume.

Nothing is written before the recipe and every data file it names have been validated, so bad input
never leaves a half-made run directory. The pipeline owns resume: a stage with a `final/` checkpoint is
done and skipped; a stage with step checkpoints continues from the newest; metrics logged after that
checkpoint by the killed run are dropped so the streams read as one uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from posttrain.data import encode_sft_dataset, read_jsonl
from posttrain.doctor import DoctorStop, LiveDoctor, Severity, load_streams, write_doctor_json
from posttrain.doctor.diagnose import RUN_RULES
from posttrain.models import build_tiny, count_parameters, load_model, load_tokenizer, train_tokenizer
from posttrain.models.tiny import PRESETS
from posttrain.runtime.checkpoint import CheckpointError, final_checkpoint, latest_checkpoint, publish
from posttrain.runtime.config import Recipe, dump_recipe
from posttrain.runtime.context import RunContext, StageResult
from posttrain.pipeline.evals import arithmetic_evals, as_json, pass_at_k_evals
from posttrain.tasks.records import EvalRecord
from posttrain.stages.pretrain import run_pretrain
from posttrain.stages.sft import run_sft
from posttrain.stages.reward_model import run_reward_model
from posttrain.stages.dpo import run_dpo
from posttrain.stages.ppo import run_ppo
from posttrain.stages.grpo import run_grpo
from posttrain.stages.rejection_sampling import produced_paths, run_rejection_sampling
from posttrain.telemetry import JsonlSink, Telemetry
from posttrain.worlds.arithmetic import ArithmeticWorld

STAGES: dict[str, Callable[..., StageResult]] = {"pretrain": run_pretrain, "sft": run_sft, "grpo": run_grpo,
                                                 "rejection_sampling": run_rejection_sampling,
                                                 "reward_model": run_reward_model, "dpo": run_dpo, "ppo": run_ppo}
BASE = "base"  # checkpoints/base: the initial model (built from scratch or loaded)


class RunError(ValueError):
    """A run that cannot start (existing folder, nothing to resume)."""


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
            "rejection_sampling": "problem"}[stage.stage]


def validate_inputs(recipe: Recipe, tokenizer, run_dir: Path) -> None:
    """Read and encode every data file the recipe names, before anything is written.

    A file an earlier rejection-sampling stage will write is accepted unread; one written by a later
    stage is an error. Raises DataError naming the file, the line and the field (or the over-long
    record)."""
    produced = produced_paths(recipe, run_dir)
    for i, stage in enumerate(recipe.stages):
        for src in getattr(stage, "data", []):
            if src.path is None:
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
    if init not in PRESETS and not (Path(init) / "config.json").is_file():
        raise RunError(f"model.init: {init!r} is neither a tiny preset {sorted(PRESETS)} nor a folder with a config.json")


def prepare_run_dir(run_dir: Path, *, resume: bool, fresh: bool) -> None:
    if resume:
        if not any((run_dir / "checkpoints").glob("*/*/trainer_state.json")) if (run_dir / "checkpoints").is_dir() else True:
            raise CheckpointError(f"{run_dir}: --resume, but this folder holds no checkpoint to resume from")
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        if not fresh:
            raise RunError(f"{run_dir}: already holds a run; pass --resume to continue it or --out for a new folder")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_world(recipe: Recipe) -> ArithmeticWorld:
    """The recipe's arithmetic world. It holds out at least `eval.per_level` problems per level (the
    world's default 200, or more where the recipe asks for a larger eval and the level has them:
    L2 and L3 are sampled from thousands), and every training split excludes them."""
    return ArithmeticWorld(seed=recipe.world_seed,
                           eval_per_level=max(ArithmeticWorld.eval_per_level, recipe.eval.per_level))


def make_base(recipe: Recipe, world: ArithmeticWorld, console: Console):
    """The initial (model, tokenizer), in memory: a tiny model with a tokenizer trained on the world,
    or the user's model folder."""
    m = recipe.model
    if m.init in PRESETS:
        # The tokenizer sees the world's pretraining prose and chat turns (as a real one sees broad text).
        texts = list(world.pretrain_documents(5000, seed_offset=99))
        texts += [f"user\n{ex[0]['content']}\nassistant\n{ex[1]['content']}" for ex in world.sft_split(2000, seed_offset=99)]
        tok = train_tokenizer(texts, vocab_size=m.vocab_size)
        model = build_tiny(m.init, vocab_size=len(tok), seed=recipe.seed, arch=m.arch, max_seq_len=m.max_seq_len,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        console.print(f"base: {m.init} ({m.arch}) built from scratch, {count_parameters(model):,} parameters, vocabulary {len(tok)}")
        return model, tok
    tok, model = load_tokenizer(m.init), load_model(m.init)
    console.print(f"base: loaded {m.init}, {count_parameters(model):,} parameters")
    return model, tok


def save_base(model, tok, run_dir: Path) -> Path:
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": 0, "stage": BASE, "final": True}))

    return publish(run_dir / "checkpoints" / BASE / "final", write)


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


def run_pipeline(recipe: Recipe, run_dir: Path, *, resume: bool = False, fresh: bool = False,
                 console: Console | None = None, world: ArithmeticWorld | None = None) -> list[EvalRecord]:
    """Run the recipe's stages into `run_dir`, evaluating after each; returns every eval record.

    `world`: the arithmetic world to use instead of `make_world(recipe)` (e.g. one whose `drawn` set
    the caller reads afterwards to check an eval set against everything the run trained on)."""
    console = console or Console()
    check_model_init(recipe)
    seed_everything(recipe.seed)
    world = world or make_world(recipe)
    base_done = final_checkpoint(run_dir / "checkpoints" / BASE) if resume else None
    if base_done is not None:
        start, tokenizer = base_done, load_tokenizer(base_done)
    else:
        base_model, tokenizer = make_base(recipe, world, console)
    validate_inputs(recipe, tokenizer, run_dir)  # before anything is written
    prepare_run_dir(run_dir, resume=resume, fresh=fresh)
    (run_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    if base_done is None:
        start = save_base(base_model, tokenizer, run_dir)
        tokenizer = load_tokenizer(start)
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    device = torch.device(recipe.device)

    # Resume: drop what the killed run logged after the checkpoint it will continue from.
    done_stages = [s.folder for s in recipe.stages if final_checkpoint(run_dir / "checkpoints" / s.folder)]
    for s in recipe.stages:
        if s.folder in done_stages:
            continue
        ckpt = latest_checkpoint(run_dir / "checkpoints" / s.folder)
        resumed_at = int(ckpt.name.split("-")[1]) if ckpt else 0
        truncate_after(run_dir / "metrics.jsonl", lambda r, f=s.folder, k=resumed_at: r.get("stage") != f or r.get("step", 0) <= k)
        truncate_after(run_dir / "phases.jsonl", lambda r, f=s.folder, k=resumed_at: r.get("stage") != f or r.get("step", 0) <= k)
        break

    t0 = time.perf_counter()
    tc = recipe.telemetry
    telemetry = Telemetry.open(run_dir, device=device, dtype=torch.bfloat16 if recipe.dtype == "bf16" else torch.float32,
                               peak_flops=tc.peak_flops, peak_bytes_per_s=tc.peak_bytes_per_s,
                               measure_cpu=tc.measure_cpu, busy_hz=tc.busy_hz, started=t0)
    sink = JsonlSink(run_dir / "metrics.jsonl")
    evals_path = run_dir / "evals.jsonl"
    dc = recipe.doctor
    doctor = LiveDoctor(every=dc.every, stop_on=Severity(dc.stop_on) if dc.stop_on else None,
                        say=lambda text: console.print(text, style="yellow", highlight=False, markup=False, soft_wrap=True))
    stopped: dict | None = None

    def evaluate(stage: str, checkpoint: Path, steps: int) -> None:
        # Between-stage evals are decode work: each generation batch is an `eval` phase with its cost.
        model = load_model(checkpoint, device=device)
        where = str(checkpoint.relative_to(run_dir))
        stage_records = arithmetic_evals(model, tokenizer, world, recipe.eval, stage=stage, checkpoint=where,
                                         phase=lambda: telemetry.phase("eval", stage=stage, step=steps))
        if recipe.eval.pass_k_samples:
            stage_records += pass_at_k_evals(model, tokenizer, world, recipe.eval, stage=stage, checkpoint=where,
                                             samples=recipe.eval.pass_k_samples, ks=(1, recipe.eval.pass_k_samples),
                                             temperature=recipe.eval.pass_k_temperature)
        with evals_path.open("a") as f:
            for r in as_json(stage_records):
                f.write(json.dumps(r) + "\n")

    try:
        # A loaded model is evaluated before the first stage: the "before" of every gain the run reports
        # (a model built from scratch is random and is not).
        if recipe.model.init not in PRESETS and not any(r.stage == BASE for r in read_evals(evals_path)):
            evaluate(BASE, start, 0)
        for index, stage in enumerate(recipe.stages):
            ctx = RunContext(run_dir=run_dir, recipe=recipe, device=device, tokenizer=tokenizer, world=world,
                             telemetry=telemetry, sink=sink, start=start, console=console, t0=t0, doctor=doctor)
            done = final_checkpoint(ctx.stage_dir(stage.folder))
            if done is not None:
                console.print(f"[dim]{stage.folder}: done, skipping")
                start = done
                continue
            console.rule(f"[bold]{stage.folder}")
            # Each stage starts from a known RNG state, so a stage re-run after a kill (before its first
            # checkpoint) sees what the uninterrupted run saw; a resumed stage restores its saved state.
            seed_everything(recipe.seed + 1000 * (index + 1))
            logged = [r for r in load_streams(run_dir).stages if r.name == stage.folder]  # a resumed stage's history
            doctor.begin(stage.folder, stage.stage, stage.model_dump(mode="json"), logged[0].records if logged else None)
            try:
                result = STAGES[stage.stage](stage, ctx)
            except DoctorStop as stop:
                stopped = stop_record(stop, run_dir, last_good_checkpoint(ctx.stage_dir(stage.folder), stop.finding.first_step, start))
                raise
            finally:
                doctor.end()
            start = result.checkpoint
            evaluate(stage.folder, start, stage.steps)
            try:
                doctor.check_run([f for rule in RUN_RULES for f in rule(load_streams(run_dir)) if f.stage == stage.folder])
            except DoctorStop as stop:
                stopped = stop_record(stop, run_dir, start)
                raise
    finally:
        sink.close()
        telemetry.close()
        try:  # every run ends with doctor.json, a stopped or crashed one too (its streams are the evidence)
            write_doctor_json(run_dir, cost=doctor.cost_json(), stopped=stopped or {}, live=list(doctor.seen.values()))
        except Exception as e:  # never mask the run's own outcome
            console.print(f"[yellow]doctor: could not write doctor.json: {type(e).__name__}: {e}")
    return read_evals(evals_path)


def read_evals(path: Path) -> list[EvalRecord]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(EvalRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
    return out
