"""What every stage shares and none should build for itself: the run's directory, device, tokenizer,
world, telemetry, metric sink, and the checkpoint the stage starts from."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import PreTrainedTokenizerBase

from posttrain.doctor import LiveDoctor
from posttrain.models import load_model
from posttrain.runtime.config import Recipe
from posttrain.rollout import make_engine
from posttrain.rollout.fused import fused_unsupported_reason
from posttrain.telemetry import MetricSink, Telemetry
from posttrain.telemetry.costs import Cost
from posttrain.worlds.arithmetic import ArithmeticWorld


class StageResult(NamedTuple):
    checkpoint: Path  # HF-format folder the next stage starts from
    metrics: dict[str, float]  # final summary; per-step metrics went to the sink


@dataclass
class RunContext:
    run_dir: Path
    recipe: Recipe
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    world: ArithmeticWorld
    telemetry: Telemetry
    sink: MetricSink
    start: Path  # the checkpoint this stage starts from (the previous stage's final)
    console: Console = field(default_factory=Console)
    t0: float = field(default_factory=time.perf_counter)
    doctor: LiveDoctor | None = None  # sees every record after the sink; may raise DoctorStop

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

    def rollout_engine(self, model: torch.nn.Module, backend: str = "native"):
        """The stage's sampler for `model`. In a bf16 run the native engine samples from bf16 copies of
        the fp32 master weights (refreshed after every update; attention and the KV cache stay fp32)
        where its fused kernels support the architecture, as the update's autocast computes in bf16."""
        options = {}
        if backend == "native" and self.amp_dtype is not None and fused_unsupported_reason(model) is None:
            options["dtype"] = self.amp_dtype
        return make_engine(backend, model, self.tokenizer, **options)

    @contextmanager
    def phase(self, name: str, *, stage: str, step: int, cost: Cost | None = None) -> Iterator[Any]:
        with self.telemetry.phase(name, stage=stage, step=step, cost=cost) as p:
            yield p

    def log(self, stage: str, step: int, metrics: dict[str, Any]) -> None:
        """One metrics.jsonl record: the stage's own metrics plus this step's phase aggregates."""
        record = {"stage": stage, "step": step, "time": round(time.perf_counter() - self.t0, 3)}
        record.update(metrics)
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
