"""The recipe: one YAML file, typed and validated before anything runs.

Every field carries a one-line reason. Unknown keys and bad values are errors that name the file,
the key path and what was expected (`RecipeError`); `key=value` overrides from the command line go
through the same validation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the file, the key and what was expected."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(Strict):
    init: str = Field("tiny-1m", description="a tiny preset to build from scratch (tiny-1m, tiny-4m, tiny-30m) or a path to a local HF model folder")
    arch: Literal["llama", "qwen2"] = Field("llama", description="architecture of a preset built from scratch")
    max_seq_len: int = Field(160, gt=8, description="context length of a model built from scratch")
    vocab_size: int = Field(512, ge=300, description="target vocabulary of the tokenizer trained for a model built from scratch")


class DataSource(Strict):
    """Where a stage's examples come from: the built-in world, or a JSONL file in our schemas."""

    world: Literal["arithmetic"] | None = Field(None, description="built-in world that generates the split")
    path: Path | None = Field(None, description="a JSONL file in the documented schema of the stage")
    n: int | None = Field(None, gt=0, description="examples to draw from the world (required with `world`)")
    weight: float = Field(1.0, gt=0, description="share of this source in the mix")

    @model_validator(mode="after")
    def _one_source(self) -> DataSource:
        if (self.world is None) == (self.path is None):
            raise ValueError("give exactly one of `world` or `path`")
        if self.world is not None and self.n is None:
            raise ValueError("`n` (how many examples to generate) is required with `world`")
        return self


class OptimConfig(Strict):
    lr: float = Field(1e-3, gt=0, description="peak AdamW learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decays to lr × this")
    warmup_steps: int = Field(20, ge=0, description="linear warmup from 0")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm")


class TrainStage(Strict):
    """Fields every optimizer-driven stage shares."""

    name: str | None = Field(None, description="checkpoint folder name; defaults to the stage kind")
    steps: int = Field(100, gt=0, description="optimizer steps")
    batch_size: int = Field(32, gt=0, description="sequences per optimizer step")
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimizer step (batch_size must divide by it)")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval_every: int = Field(0, ge=0, description="steps between in-stage evals (0 = only at the end)")
    save_every: int = Field(50, gt=0, description="steps between resumable checkpoints")
    keep_last: int = Field(2, gt=0, description="resumable checkpoints kept")
    log_every: int = Field(10, gt=0, description="steps between metrics.jsonl records")

    @model_validator(mode="after")
    def _accum_divides(self) -> TrainStage:
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by grad_accum {self.grad_accum}")
        return self

    @property
    def folder(self) -> str:
        return self.name or self.stage  # type: ignore[attr-defined]


class PretrainStage(TrainStage):
    stage: Literal["pretrain"] = "pretrain"
    seq_len: int = Field(128, gt=8, description="packed tokens per row")
    documents: int = Field(50_000, gt=0, description="world documents in the pretraining stream")


class SFTStage(TrainStage):
    stage: Literal["sft"] = "sft"
    data: list[DataSource] = Field(default_factory=lambda: [DataSource(world="arithmetic", n=20_000)])
    max_len: int = Field(128, gt=8, description="longest example in tokens")
    truncation: Literal["error", "drop"] = Field("error", description="an over-long example: stop with an error, or drop it and count it")
    heldout: int = Field(256, ge=0, description="world examples held out for eval loss")


Stage = Annotated[PretrainStage | SFTStage, Field(discriminator="stage")]


class EvalConfig(Strict):
    per_level: int = Field(200, gt=0, description="held-out problems per level (fewer where a level has fewer)")
    levels: list[str] = Field(default_factory=lambda: ["L1", "L2", "L3", "L4"], description="world levels to evaluate")
    max_new_tokens: int = Field(48, gt=0, description="greedy answer budget")
    batch_size: int = Field(128, gt=0, description="prompts per generation batch")


class TelemetryConfig(Strict):
    peak_flops: float | None = Field(None, gt=0, description="override the device's dense peak FLOP/s at the run dtype")
    peak_bytes_per_s: float | None = Field(None, gt=0, description="override the device's memory bandwidth")
    measure_cpu: bool = Field(True, description="on a CPU without a cached measurement, measure the roofs (a few seconds) at start")
    busy_hz: float = Field(20.0, gt=0, le=1000, description="busy-line sampling rate")


class Recipe(Strict):
    name: str = Field("run", description="run folder name under runs/")
    seed: int = Field(0, description="seeds the world, the model init, and every RNG")
    device: str = Field("cpu", description="torch device")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="training precision (bf16 = autocast, fp32 master weights)")
    threads: int | None = Field(None, gt=0, description="torch intra-op threads (default: torch's)")
    world_seed: int = Field(0, description="seed of the arithmetic world's splits")
    model: ModelConfig = Field(default_factory=ModelConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    stages: list[Stage] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_folders(self) -> Recipe:
        names = [s.folder for s in self.stages]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"two stages write the same checkpoint folder {sorted(dup)}; give them distinct `name`s")
        return self


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("pretrain", "sft") or str(part).startswith("function-"):
            continue  # pydantic's discriminator tag, not a key the user wrote
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        got = "" if e["type"] in ("missing", "extra_forbidden") else f" (got {e.get('input')!r})"
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{source}: {_loc(e['loc'])}: {msg}{got}")
    return "\n".join(lines)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`stages.1.optim.lr=3e-4` style overrides; values parsed as YAML scalars."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected key=value")
        key, value = item.split("=", 1)
        node: Any = raw
        parts = key.split(".")
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        last = parts[-1]
        parsed = yaml.safe_load(value)
        if isinstance(node, list):
            node[int(last)] = parsed
        else:
            node[last] = parsed
    return raw


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: expected a mapping of recipe keys at the top level")
    try:
        raw = apply_overrides(raw, overrides or [])
    except (KeyError, IndexError, ValueError, TypeError) as e:
        raise RecipeError(f"{path}: bad override: {e}") from None
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(format_validation_error(e, str(path))) from None


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
