"""Device peaks: the table is dense and detected by name; CPU measurement caches; unknown never reads 0."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.telemetry import devices
from posttrain.telemetry.devices import (
    PEAKS_TABLE,
    Peaks,
    detect,
    lookup,
    missing_peaks_message,
)


@pytest.mark.parametrize("reported, row", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H200", "NVIDIA H200"),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB SXM"),
    ("NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB PCIe"),
    ("NVIDIA L4", "NVIDIA L4"),
    ("NVIDIA L40S", "NVIDIA L40S"),
    ("NVIDIA A10G", "NVIDIA A10G"),
    ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"),
    ("AMD Instinct MI300X", "AMD Instinct MI300X"),
    ("NVIDIA B200", "NVIDIA B200"),
])
def test_lookup_by_reported_name(reported, row):
    spec = lookup(reported)
    assert spec is not None and spec.name == row


def test_unlisted_device_is_not_matched():
    assert lookup("NVIDIA L40") is None  # L40 (not L40S) is not in the table: must not fall into L4
    assert lookup("Some NPU") is None


def test_table_holds_dense_figures_with_sources():
    by_name = {s.name: s for s in PEAKS_TABLE}
    # dense, not the 2:4-sparse marketing figure: H100 SXM bf16 989.4 (sparse 1,979), A100 312 (624),
    # MI300X 1,307.4 (2,614.9), L4 121 (242)
    assert by_name["NVIDIA H100 SXM"].flops["bf16"] == pytest.approx(989.4e12)
    assert by_name["NVIDIA A100 40GB"].flops["bf16"] == pytest.approx(312e12)
    assert by_name["AMD Instinct MI300X"].flops["bf16"] == pytest.approx(1307.4e12)
    assert by_name["NVIDIA L4"].flops["bf16"] == pytest.approx(121e12)
    assert by_name["NVIDIA H200"].bytes_per_s == pytest.approx(4.8e12)
    for spec in PEAKS_TABLE:
        assert spec.source and spec.bytes_per_s > 0
        assert set(spec.flops) >= {"fp32", "bf16", "fp16"}
        # fp32 (non-tensor) is always well under the bf16 tensor rate on these parts
        assert spec.flops["fp32"] < spec.flops["bf16"]


def test_cpu_without_measurement_is_unknown_not_zero(tmp_path, monkeypatch):
    monkeypatch.setenv(devices.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(devices.ENV_PEAK_FLOPS, raising=False)
    monkeypatch.delenv(devices.ENV_PEAK_BYTES, raising=False)
    peaks = detect("cpu", "fp32")
    assert peaks.flops == {} and peaks.bytes_per_s is None
    message = missing_peaks_message(peaks, "fp32")
    assert message is not None and "unknown peak" in message and devices.ENV_PEAK_FLOPS in message
    assert "posttrain roofline --measure" in message


def test_env_and_explicit_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv(devices.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setenv(devices.ENV_PEAK_FLOPS, "2e11")
    monkeypatch.setenv(devices.ENV_PEAK_BYTES, "5e10")
    peaks = detect("cpu", "bf16")
    assert peaks.flops == {"bf16": 2e11} and peaks.bytes_per_s == 5e10
    assert missing_peaks_message(peaks, "bf16") is None
    explicit = detect("cpu", "bf16", peak_flops=3e11)  # the recipe's field wins over the env var
    assert explicit.flops["bf16"] == 3e11 and "recipe" in explicit.source
    monkeypatch.setenv(devices.ENV_PEAK_FLOPS, "fast")
    with pytest.raises(ValueError, match="POSTTRAIN_PEAK_FLOPS='fast'"):
        detect("cpu", "bf16")


@pytest.mark.usefixtures("one_thread")  # two OpenMP threads on a loaded machine wait on each other: 25 MFLOP/s measured
def test_measure_cpu_caches_per_machine_and_thread_count(tmp_path, monkeypatch):
    monkeypatch.setenv(devices.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(devices.ENV_PEAK_FLOPS, raising=False)
    monkeypatch.delenv(devices.ENV_PEAK_BYTES, raising=False)
    measured = devices.measure_cpu_peaks(matmul_n=128, stream_mib=8, seconds_each=0.05, dtypes=("fp32",))
    assert measured.flops["fp32"] > 1e8 and measured.bytes_per_s > 1e8  # any CPU beats 0.1 GFLOP/s, 0.1 GB/s
    assert "matmul 128x128" in measured.source and "streaming read" in measured.source
    path = devices.cache_path()
    assert path.parent == tmp_path and path.name.startswith("roofline-")
    cached = json.loads(path.read_text())
    assert cached["threads"] == torch.get_num_threads()
    assert detect("cpu", "fp32").flops["fp32"] == measured.flops["fp32"]  # read back from the cache
    cached["threads"] += 1
    path.write_text(json.dumps(cached))
    assert devices.load_cpu_peaks() is None  # measured with other threads: stale


def test_device_json_round_trip():
    peaks = Peaks(name="X", kind="cuda", flops={"bf16": 1e14}, bytes_per_s=1e12, source="table: X")
    obj = peaks.to_json(torch.bfloat16)
    assert obj == {"name": "X", "kind": "cuda", "peaks": {"flops": {"bf16": 1e14}, "bytes_per_s": 1e12},
                   "source": "table: X", "dtype": "bf16"}
    assert Peaks.from_json(obj) == peaks


def test_a_dtype_too_slow_for_the_full_size_is_measured_smaller():
    assert devices._matmul_size(torch.float32, 2048, budget=1e9) == 2048        # fits: the full size
    assert devices._matmul_size(torch.float32, 2048, budget=1e-9) == 256        # far too slow: the smallest
    assert devices._matmul_size(torch.float32, 128, budget=1e-9) == 128         # never above the size asked


def test_bf16_on_a_cpu_without_bf16_instructions_is_named_slow(monkeypatch):
    monkeypatch.setattr(devices, "_onednn_bf16", lambda: False)
    why = devices.slow_bf16_reason("cpu")
    assert why is not None and "bf16" in why and "fp32" in why
    monkeypatch.setattr(devices, "_onednn_bf16", lambda: True)
    assert devices.slow_bf16_reason("cpu") is None
    assert devices.slow_bf16_reason("meta") is None                             # a CPU question only
