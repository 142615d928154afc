"""The command bodies: `posttrain phases RUN_DIR` on a synthetic run dir, `posttrain roofline` from cache."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from posttrain.telemetry import devices
from posttrain.telemetry.cli import phases_command, roofline_command
from posttrain.telemetry.devices import Peaks
from posttrain.telemetry.phases import PhaseRecord


def _console() -> Console:
    return Console(record=True, width=200, color_system=None)


def test_phases_table_and_gap(tmp_path):
    peaks = Peaks(name="synthetic", kind="cpu", flops={"fp32": 100e9}, bytes_per_s=10e9, source="test")
    (tmp_path / "device.json").write_text(json.dumps(peaks.to_json("fp32")))
    records = [PhaseRecord("grpo", 1, "generate", 0.0, 3.0, 3e9, 3e9, 0.95, None),
               PhaseRecord("grpo", 1, "update", 3.0, 1.0, 60e9, 0.6e9, 1.0, None)]
    (tmp_path / "phases.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    console = _console()
    phases_command(tmp_path, console=console)
    text = console.export_text()
    # generate: 75% share, 1.0 GFLOP/s, I = 1, 1.0% of compute roof, 10.0% of bandwidth, overhead, busy 95%
    assert "generate" in text and "75%" in text and "overhead" in text and "95%" in text
    # update: 60.0 GFLOP/s, I = 100, 60.0% of compute roof, compute-bound
    assert "60.0%" in text and "compute" in text
    # cycle: U = 63/400 = 16%, busy (2.85+1)/4 = 96%
    assert "achieved 16% of the compute roof" in text and "busy line reads 96%" in text
    assert "20:1" in text  # projection rows


def test_phases_command_bad_run_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        phases_command(tmp_path / "nope", console=_console())
    with pytest.raises(FileNotFoundError, match="phases.jsonl not found"):
        phases_command(tmp_path, console=_console())


def test_roofline_prints_cached_cpu_roofs(tmp_path, monkeypatch):
    monkeypatch.setenv(devices.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(devices.ENV_PEAK_FLOPS, raising=False)
    monkeypatch.delenv(devices.ENV_PEAK_BYTES, raising=False)
    console = _console()
    roofline_command(False, console=console)
    assert "unknown peak" in console.export_text()  # nothing cached yet: says so, and how
    import torch
    cached = Peaks(name="test-cpu", kind="cpu", flops={"fp32": 188e9, "bf16": 417e9}, bytes_per_s=53e9,
                   source="measured (test)").to_json("fp32") | {"threads": torch.get_num_threads()}
    devices.cache_path().write_text(json.dumps(cached))
    console = _console()
    roofline_command(False, console=console)
    text = console.export_text()
    # ridge fp32 = 188/53 = 3.5 FLOP/B; bf16 = 417/53 = 7.9
    assert "188.0 GFLOP/s" in text and "53.0 GB/s" in text and "3.5 FLOP/B" in text and "7.9 FLOP/B" in text


def _records_with_memory(tmp_path) -> None:
    peaks = Peaks(name="synthetic", kind="cpu", flops={"fp32": 100e9}, bytes_per_s=10e9, source="test")
    (tmp_path / "device.json").write_text(json.dumps(peaks.to_json("fp32")))
    records = [PhaseRecord("grpo", 1, "generate", 0.0, 3.0, 3e9, 3e9, 0.95, None, mem_peak=3 * 2**30, mem_start=2**30),
               PhaseRecord("grpo", 1, "reference", 3.0, 0.5, 20e9, 1e9, 0.97, None, mem_peak=2**31),
               PhaseRecord("grpo", 1, "update", 3.5, 1.0, 60e9, 0.6e9, 1.0, None, mem_peak=5 * 2**29),
               PhaseRecord("grpo", 1, "sync", 4.5, 0.01, 0.0, 4e7, None, None, mem_peak=2**31)]
    (tmp_path / "phases.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))


@pytest.mark.parametrize("width", [80, 100])
def test_phases_fits_80_columns_with_a_legend(tmp_path, width):
    _records_with_memory(tmp_path)
    console = Console(record=True, width=width, color_system=None)
    phases_command(tmp_path, console=console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text                                   # nothing cut: every header and value whole
    for header in ("share", "GFLOP/s", "GB/s", "F/B", "%C", "%B", "verdict", "busy", "mem"):
        assert f" {header} " in text or text.count(header) > 0, header
    assert "%C / %B = % of the compute / bandwidth roof" in " ".join(text.split())   # the legend says what they are
    # memory: generate peaked at 3 GiB, update at 2.5 GiB; sync 40 MB in 0.01 s = 4.00 GB/s, 40% of 10 GB/s
    assert "3 GiB" in text and "2.5 GiB" in text and "40.0%" in text


def test_phases_spells_headers_out_when_wide(tmp_path):
    _records_with_memory(tmp_path)
    console = Console(record=True, width=160, color_system=None)
    phases_command(tmp_path, console=console)
    text = console.export_text()
    assert "% compute roof" in text and "% bandwidth roof" in text and "peak memory" in text
    assert "F/B = FLOP per byte" not in text                 # no legend needed
