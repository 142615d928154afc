"""Metric sinks: JSON Lines append + flush, fan-out, optional backends with clear errors."""

from __future__ import annotations

import json
import sys
import types

import pytest

from posttrain.telemetry.sinks import (
    JsonlSink,
    MetricSink,
    MultiSink,
    TensorBoardSink,
    WandbSink,
)


def test_jsonl_appends_and_flushes_each_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log({"stage": "sft", "step": 1, "loss/sft": 2.5, "phase/update/bound": "compute"})
    # flushed: readable before close
    assert json.loads(path.read_text().splitlines()[0])["loss/sft"] == 2.5
    sink.close()
    again = JsonlSink(path)  # reopening appends, it does not truncate
    again.log({"stage": "sft", "step": 2, "loss/sft": float("nan")})
    again.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["step"] == 2
    with pytest.raises(ValueError, match="after close"):
        again.log({"step": 3})


class Recorder:
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.closed = False

    def log(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        self.closed = True


def test_multisink_fans_out_and_checks_its_members():
    a, b = Recorder(), Recorder()
    assert isinstance(a, MetricSink)
    multi = MultiSink(a, b)
    multi.log({"step": 1})
    multi.close()
    assert a.records == b.records == [{"step": 1}] and a.closed and b.closed
    with pytest.raises(TypeError, match="expected a MetricSink"):
        MultiSink(a, object())  # type: ignore[arg-type]


def test_wandb_sink_prefixes_with_stage(monkeypatch):
    logged: list[dict] = []
    run = types.SimpleNamespace(log=logged.append, finish=lambda: logged.append({"finished": True}))
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = WandbSink(project="p")
    sink.log({"stage": "sft", "step": 4, "loss/sft": 1.5})
    sink.close()
    assert logged == [{"sft/step": 4, "sft/loss/sft": 1.5}, {"finished": True}]


def test_missing_optional_packages_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # None in sys.modules makes `import wandb` fail
    with pytest.raises(ImportError, match=r"posttrain\[wandb\]"):
        WandbSink(project="p")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"posttrain\[tensorboard\]"):
        TensorBoardSink("runs/tb")
