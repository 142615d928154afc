"""Metric sinks: where the flat per-step dicts go. metrics.jsonl always; TensorBoard and W&B optional.

A record is a flat dict of namespaced scalars — `{"stage": "sft", "step": 3, "time": 12.5,
"loss/sft": 1.9, "phase/update/bound": "compute", …}` (docs/run_dir.md). Numbers go everywhere;
strings (like a verdict) go to JSON Lines and W&B, and are skipped by TensorBoard (it plots scalars).

Non-finite floats are written as JSON `NaN` / `Infinity` (Python's `json` default), which Python's
reader accepts: a NaN loss is evidence the doctor must see, not a value to drop.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class MetricSink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per line and flushes it, so a killed run loses at most the line in flight."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        if self._file.closed:
            raise ValueError(f"JsonlSink({self.path}): log() after close()")
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step",)}


class TensorBoardSink:
    """Scalars under `<stage>/<key>`, global step = the record's `step` (per stage, as in metrics.jsonl)."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("TensorBoardSink needs the `tensorboard` package: "
                              "pip install 'posttrain[tensorboard]'") from err
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        stage, step = record.get("stage", "run"), int(record.get("step", 0))
        for key, value in _scalars(record).items():
            if math.isfinite(value):
                self._writer.add_scalar(f"{stage}/{key}", value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One `wandb.log` per record, keys prefixed with the stage; W&B's own step counter stays monotonic."""

    def __init__(self, *, project: str, name: str | None = None, config: dict[str, Any] | None = None,
                 dir: str | Path | None = None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("WandbSink needs the `wandb` package: pip install 'posttrain[wandb]'") from err
        self._wandb = wandb
        self._run = wandb.init(project=project, name=name, config=config, dir=str(dir) if dir else None)

    def log(self, record: dict[str, Any]) -> None:
        stage = record.get("stage", "run")
        payload = {f"{stage}/{k}": v for k, v in record.items() if k != "stage"}
        self._run.log(payload)

    def close(self) -> None:
        self._run.finish()


class MultiSink:
    """Fans each record out to several sinks, in order."""

    def __init__(self, *sinks: MetricSink) -> None:
        for sink in sinks:
            if not isinstance(sink, MetricSink):
                raise TypeError(f"MultiSink: {sink!r} has no log(record) / close(); expected a MetricSink")
        self.sinks = list(sinks)

    def log(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_jsonl_records(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(1-based line, object) of a run's JSON Lines stream, as `JsonlSink` writes it.

    A truncated last line (the one a killed run was writing) is dropped; any other bad line is a
    ValueError naming `path:line`."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # the line a killed run was writing
            raise ValueError(f"{path}:{i + 1}: not valid JSON: {line[:80]!r}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{i + 1}: expected a JSON object, got {type(obj).__name__}")
        out.append((i + 1, obj))
    return out
