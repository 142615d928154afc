"""What every stage shares and none should build for itself: the run's directory, device, tokenizer,
the recipe's tasks (built on first use), telemetry, metric sink, the checkpoint the stage starts from,
and the data-parallel ranks it runs on."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import PreTrainedTokenizerBase

from posttrain.distributed import DistributedError, World
from posttrain.doctor import LiveDoctor
from posttrain.models import load_model
from posttrain.runtime.config import EvalSpec, Recipe
from posttrain.rollout import RolloutEngine, make_engine
from posttrain.rollout.cpu import fused_unsupported_reason
from posttrain.telemetry import MetricSink, Telemetry
from posttrain.telemetry.costs import Cost
from posttrain.telemetry.phases import MAIN_WORKER
from posttrain.telemetry.ranks import gather_phases
from posttrain.tasks import EvalRequest, Task, TaskSet, build_task
from posttrain.tasks.verified import JsonlTask


def make_tasks(recipe: Recipe, world: Any = None) -> TaskSet:
    """The recipe's tasks by name, none built yet. `world`: an ArithmeticWorld to use for `arithmetic`
    (e.g. one whose `drawn` set a caller reads afterwards); it is used only if the recipe names it."""
    factories = {n: (lambda n=n: build_task(n, world_seed=recipe.world_seed, world=world,
                                            arithmetic_eval_per_level=recipe.arithmetic_eval_per_level(n)))
                 for n in recipe.task_names()}
    for e in recipe.evals:
        if e.path is not None:
            factories[eval_key(e)] = lambda e=e: JsonlTask(e.path, e.verifier or "", name=e.name, params=e.params)
    return TaskSet(factories)


def eval_key(spec: EvalSpec) -> str:
    return spec.task if spec.task is not None else f"path:{spec.path}"


def eval_request(spec: EvalSpec, *, seed: int = 0) -> EvalRequest:
    return EvalRequest(levels=tuple(spec.levels) if spec.levels is not None else None, per_level=spec.per_level_or_default,
                       greedy=spec.greedy, k=tuple(spec.k), samples=spec.samples, temperature=spec.temperature,
                       max_new_tokens=spec.max_new_tokens, batch_size=spec.batch_size, probe=spec.probe, seed=seed)


def eval_plan(recipe: Recipe, tasks: TaskSet) -> list[tuple[EvalSpec, Task, EvalRequest]]:
    """The recipe's evals, in order: each with its task and what to measure."""
    return [(e, tasks.get(eval_key(e)), eval_request(e)) for e in recipe.evals]


class StageResult(NamedTuple):
    checkpoint: Path  # HF-format folder the next stage starts from
    metrics: dict[str, float]  # final summary; per-step metrics went to the sink


@dataclass
class RunContext:
    run_dir: Path
    recipe: Recipe
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    tasks: TaskSet  # the tasks the recipe names, each built on first use (docs/tasks.md)
    telemetry: Telemetry
    sink: MetricSink
    start: Path  # the checkpoint this stage starts from (the previous stage's final)
    console: Console = field(default_factory=Console)
    t0: float = field(default_factory=time.perf_counter)
    doctor: LiveDoctor | None = None  # sees every record after the sink; may raise DoctorStop
    # the data-parallel ranks (docs/distributed.md); on ranks other than 0 the sink, telemetry and doctor
    # are null ones: only rank 0 writes the run folder
    ranks: World = field(default_factory=World)
    # the Ray-placed engines this run made (recipe `placement:`): their sync/restart metrics join `log`
    placed: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def stage_dir(self, folder: str) -> Path:
        return self.run_dir / "checkpoints" / folder

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.recipe.dtype == "bf16" else None

    def autocast(self):
        """bf16 autocast over fp32 master weights, or nothing in fp32."""
        if self.amp_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def load_model(self, path: Path):
        """A checkpoint of this run on its device, with the recipe's attention kernels."""
        return load_model(path, device=self.device, attention=self.recipe.model.attention, autocast_dtype=self.amp_dtype)

    def rollout_engine(self, model: torch.nn.Module, backend: str = "native",
                       tokenizer: PreTrainedTokenizerBase | None = None) -> RolloutEngine:
        """The stage's sampler for `model` (with `tokenizer`, default the run's: a distillation teacher
        brings its own). In a bf16 run the native engine samples from bf16 copies of
        the fp32 master weights (refreshed after every update; attention and the KV cache stay fp32)
        where its fused kernels support the architecture, as the update's autocast computes in bf16."""
        options = {}
        if backend == "native" and self.amp_dtype is not None and fused_unsupported_reason(model) is None:
            options["dtype"] = self.amp_dtype
        if self.recipe.placement is None:
            return make_engine(backend, model, tokenizer or self.tokenizer, **options)
        # placement: the rollouts run on Ray actors (docs/placement.md); the learner stays here
        from posttrain.distributed.ray_engine import Placement, RayRolloutEngine  # ray is an optional extra

        if self.ranks.world_size > 1:
            raise DistributedError("placement: Ray rollout workers with torchrun ranks are not supported yet; "
                                   "remove `placement:` or run one process")
        engine = RayRolloutEngine(model, tokenizer or self.tokenizer, placement=Placement(**self.recipe.placement.model_dump()),
                                  backend=backend, options=options)
        engine.attach(self.telemetry)
        self.placed.add(engine)
        return engine

    @contextmanager
    def phase(self, name: str, *, stage: str, step: int, cost: Cost | None = None,
              worker: str = MAIN_WORKER) -> Iterator[Any]:
        with self.telemetry.phase(name, stage=stage, step=step, cost=cost, worker=worker) as p:
            yield p

    def log(self, stage: str, step: int, metrics: dict[str, Any]) -> None:
        """One metrics.jsonl record: the stage's own metrics plus this step's phase aggregates.

        Data-parallel: every rank calls it at the same steps — it gathers the other ranks' phases to rank 0
        (one collective, a sync point: posttrain/telemetry/ranks.py) before folding the step's phases."""
        gather_phases(self.telemetry, rank=self.ranks.rank, world_size=self.ranks.world_size)
        record = {"stage": stage, "step": step, "time": round(time.perf_counter() - self.t0, 3)}
        record.update(metrics)
        for engine in list(self.placed):
            record.update(engine.take_metrics())
        record.update(self.telemetry.step_metrics(stage=stage, step=step))
        self.sink.log(record)
        if self.doctor is not None:
            self.doctor.observe(record)  # written first: a stop leaves the evidence in metrics.jsonl

    def progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=self.console, transient=False,
        )
