"""The decode-matmul tuner: measures once, keeps the static choice unless beaten by the margin, remembers."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.models import build_tiny
from posttrain.rollout.cpu import tuning
from posttrain.rollout.cpu.fused import FusedWeights
from posttrain.rollout.cpu.projections import projection_kind
from posttrain.telemetry.devices import ENV_CACHE_DIR

CPU = torch.device("cpu")


@pytest.fixture
def weights(monkeypatch, tmp_path):
    """tiny-4m's fused fp32 weights, reported as large (so they count as streaming from memory); an
    empty cache folder and memo."""
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(tuning.ENV_TUNE, raising=False)
    monkeypatch.setattr(tuning, "_memo", {})
    w = FusedWeights(build_tiny("tiny-4m", vocab_size=300, seed=0))
    w.refresh()
    w.nbytes = 100 << 20
    return w


def fake_measure(seconds: dict[str, float], calls: list):
    def measure(weights, kinds, rows, reps=3):
        calls.append((tuple(kinds), rows))
        return {k: seconds.get(k, 1.0) for k in kinds}
    return measure


def test_fastest_form_wins_and_is_remembered_on_disk(weights, monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(tuning, "measure", fake_measure({"mm": 3.0, "mkl": 2.0, "dnn": 1.0}, calls))
    assert tuning.tuned_kind(weights, torch.float32, 5, CPU) == "dnn"
    assert calls == [(tuple(tuning.candidates(torch.float32, 8)), 8)]      # measured at the bucket: 5 → 8 rows
    assert tuning.tuned_kind(weights, torch.float32, 7, CPU) == "dnn"      # same bucket: the process memo
    monkeypatch.setattr(tuning, "_memo", {})                              # a new process: the file answers
    assert tuning.tuned_kind(weights, torch.float32, 8, CPU) == "dnn"
    assert len(calls) == 1
    (entry,) = json.loads(tuning.cache_file().read_text()).values()
    assert entry["kind"] == "dnn" and entry["us_per_pass"]["mm"] == 3_000_000


def test_a_choice_cached_by_an_older_measure_is_measured_again(weights, monkeypatch):
    calls: list = []
    monkeypatch.setattr(tuning, "measure", fake_measure({"mm": 3.0, "mkl": 2.0, "dnn": 1.0}, calls))
    key = tuning._key(weights, torch.float32, 8)
    old = {"kind": "mm", "static": "mkl", "us_per_pass": {"mm": 7220, "mkl": 8855, "dnn": 7803}}  # no "method"
    tuning.cache_file().write_text(json.dumps({key: old}))
    assert tuning.tuned_kind(weights, torch.float32, 8, CPU) == "dnn"
    assert len(calls) == 1
    entry = json.loads(tuning.cache_file().read_text())[key]
    assert entry["kind"] == "dnn" and entry["method"] == tuning.METHOD
    monkeypatch.setattr(tuning, "_memo", {})
    assert tuning.tuned_kind(weights, torch.float32, 8, CPU) == "dnn" and len(calls) == 1  # now current: kept


def test_a_choice_made_under_load_is_measured_again_when_quieter(weights, monkeypatch):
    calls: list = []
    monkeypatch.setattr(tuning, "measure", fake_measure({"mm": 3.0, "mkl": 2.0, "dnn": 1.0}, calls))
    load = {"load_per_core": 3.0}                                     # measured at 3 runnable jobs per core
    monkeypatch.setattr(tuning, "machine_load", lambda: dict(load))
    assert tuning.tuned_kind(weights, torch.float32, 8, CPU) == "dnn" and len(calls) == 1
    key = tuning._key(weights, torch.float32, 8)
    assert json.loads(tuning.cache_file().read_text())[key]["load_per_core"] == 3.0
    load["load_per_core"] = 2.8                                       # as busy (within 0.5 per core): kept
    monkeypatch.setattr(tuning, "_memo", {})
    assert tuning.tuned_kind(weights, torch.float32, 8, CPU) == "dnn" and len(calls) == 1
    load["load_per_core"] = 0.1                                       # quiet now: measured again, load updated
    monkeypatch.setattr(tuning, "_memo", {})
    assert tuning.tuned_kind(weights, torch.float32, 8, CPU) == "dnn" and len(calls) == 2
    assert json.loads(tuning.cache_file().read_text())[key]["load_per_core"] == 0.1
    monkeypatch.setattr(tuning, "_memo", {})                          # measured quiet: never again
    assert tuning.tuned_kind(weights, torch.float32, 8, CPU) == "dnn" and len(calls) == 2


def test_forms_take_turns_over_the_rounds(weights, monkeypatch):
    built: list[str] = []
    real = tuning.make_projection

    def recording(w, b, kind, rows):
        if not built or built[-1] != kind:
            built.append(kind)
        return real(w, b, kind, rows)
    monkeypatch.setattr(tuning, "make_projection", recording)
    kinds = ["mm", "dnn"] if "dnn" in tuning.candidates(torch.float32, 8) else ["mm", "mkl"]
    seconds = tuning.measure(weights, kinds, rows=8, rounds=3, reps=1)
    assert built == kinds * 3                      # round-robin, not every round of one form in a row
    assert set(seconds) == set(kinds) and all(0 < s < 5 for s in seconds.values())


def test_static_choice_kept_within_the_margin(weights, monkeypatch):
    static = projection_kind(torch.float32, 8, CPU, weights.nbytes)
    # the static form at 1.04 s, another at 1.00 s: 4% < 5%, not worth a change of round-off
    monkeypatch.setattr(tuning, "measure", fake_measure({"dnn": 1.0, "mm": 1.0, "mkl": 1.0} | {static: 1.04}, []))
    assert tuning.tuned_kind(weights, torch.float32, 8, CPU) == static


def test_no_measurement_on_other_devices_or_when_off(weights, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("measured")
    monkeypatch.setattr(tuning, "measure", refuse)
    big = weights.nbytes
    assert tuning.tuned_kind(weights, torch.float32, 8, torch.device("meta")) == "mm"
    monkeypatch.setenv(tuning.ENV_TUNE, "0")
    assert tuning.tuned_kind(weights, torch.float32, 8, CPU) == projection_kind(torch.float32, 8, CPU, big)


def test_cache_resident_weights_are_measured_too(weights, monkeypatch):
    """Small weights were left on the static `mm`; since our packed matmul beats MKL there, they are measured."""
    weights.nbytes = 1 << 20
    calls: list = []
    monkeypatch.setattr(tuning, "measure", fake_measure({k: 1.0 for k in tuning.candidates(torch.float32, 8)}
                                                        | {"mm": 2.0}, calls))
    assert tuning.tuned_kind(weights, torch.float32, 8, CPU) != "mm" and calls


def test_measure_times_every_candidate_on_the_real_weights(weights):
    kinds = tuning.candidates(torch.float32, 1)
    assert "mm" in kinds and "mv" in kinds
    seconds = tuning.measure(weights, kinds, rows=1, rounds=1, reps=1)
    assert set(seconds) == set(kinds) and all(0 < s < 5 for s in seconds.values())


def test_rows_bucket():
    assert [tuning.rows_bucket(r) for r in (1, 2, 3, 8, 9, 64, 65, 1000)] == [1, 2, 4, 8, 16, 64, 128, 256]
