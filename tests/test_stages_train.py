"""Pretrain and SFT: the gradient-accumulation invariant, and tiny-model smoke runs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from posttrain.data import encode_sft, parse_record
from posttrain.models import build_tiny
from posttrain.runtime.config import OptimConfig, Recipe
from posttrain.pipeline.run import run_pipeline
from posttrain.stages._training import Trainer, optimizer_step
from posttrain.stages.sft import sft_batch_loss
from conftest import tiny_recipe_dict


def _grads(model, chunks, pad_id, num_tokens) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for chunk in chunks:
        loss, _ = sft_batch_loss(model, chunk, pad_id, num_tokens)
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_grad_accumulation_8x1_equals_1x8(tokenizer, world):
    torch.manual_seed(0)
    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id).double()
    rows = world.sft_split(8)
    enc = [encode_sft(parse_record({"messages": r}, "sft"), tokenizer, 128) for r in rows]
    enc.sort(key=lambda e: len(e.input_ids))  # as the stage does: length-grouped micro-batches
    n_tokens = sum(sum(1 for y in e.labels[1:] if y != -100) for e in enc)
    whole = _grads(model, [enc], tokenizer.pad_token_id, n_tokens)
    micro = _grads(model, [[e] for e in enc], tokenizer.pad_token_id, n_tokens)
    for name, g in whole.items():
        torch.testing.assert_close(micro[name], g, rtol=1e-9, atol=1e-12, msg=name)
    # The naive per-micro-batch mean weights short examples more: it must differ.
    model.zero_grad(set_to_none=True)
    for e in enc:
        own = sum(1 for y in e.labels[1:] if y != -100)
        (sft_batch_loss(model, [e], tokenizer.pad_token_id, own)[0] / len(enc)).backward()
    naive = model.model.embed_tokens.weight.grad
    assert not torch.allclose(naive, whole["model.embed_tokens.weight"], rtol=1e-3, atol=0)


def test_a_bf16_batch_padded_to_the_bucket_has_the_unpadded_loss(tokenizer, world, monkeypatch):
    """Under bf16 autocast on a CPU the batch's length is padded to a multiple of `SFT_BUCKET` (oneDNN builds a
    kernel per shape): pad columns carry no label and are masked from attention, so the loss and its token
    count are those of the unpadded batch, to bf16 round-off (the matmuls' other row counts)."""
    import posttrain.stages.sft as sft

    model = build_tiny("tiny-1m", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    rows = world.sft_split(4)
    enc = [encode_sft(parse_record({"messages": r}, "sft"), tokenizer, 128) for r in rows]
    longest = max(len(e.input_ids) for e in enc)
    assert longest % sft.SFT_BUCKET  # the case does pad
    seen = []
    real = sft.collate_sft
    monkeypatch.setattr(sft, "collate_sft", lambda *a, **k: seen.append(k.get("pad_to")) or real(*a, **k))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        padded, n_padded = sft_batch_loss(model, enc, tokenizer.pad_token_id, 100)
        monkeypatch.setattr(sft, "SFT_BUCKET", 1)
        plain, n_plain = sft_batch_loss(model, enc, tokenizer.pad_token_id, 100)
    assert seen == [-(-longest // 8) * 8, longest]
    assert n_padded == n_plain
    torch.testing.assert_close(padded, plain, atol=2e-2, rtol=0)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "r"
    d = tiny_recipe_dict()
    d["stages"][0]["steps"] = 12
    d["stages"][1]["steps"] = 12
    run_pipeline(Recipe.model_validate(d), out)
    return out


def _metrics(out, stage):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["stage"] == stage]


@pytest.mark.parametrize(("stage", "before", "loss_key"), [("pretrain", "base", "loss/lm"), ("sft", "pretrain", "loss/sft")])
def test_every_parameter_changed_and_loss_fell(tiny_run, stage, before, loss_key):
    a = load_file(tiny_run / "checkpoints" / before / "final" / "model.safetensors")
    b = load_file(tiny_run / "checkpoints" / stage / "final" / "model.safetensors")
    unchanged = [n for n in a if torch.equal(a[n], b[n])]
    assert not unchanged, f"{stage} left parameters untouched: {unchanged}"
    m = _metrics(tiny_run, stage)
    first, last = m[0][loss_key], sum(r[loss_key] for r in m[-3:]) / 3
    assert last < first, (first, last)


def test_run_folder_contract(tiny_run):
    for name in ["recipe.yaml", "metrics.jsonl", "phases.jsonl", "device.json", "evals.jsonl"]:
        assert (tiny_run / name).is_file(), name
    phases = [json.loads(x) for x in (tiny_run / "phases.jsonl").read_text().splitlines()]
    assert {p["name"] for p in phases} >= {"update", "eval"}
    updates = [p for p in phases if p["name"] == "update"]
    assert all(p["flops"] > 0 and p["bytes"] > 0 and p["seconds"] > 0 for p in updates)
    evals = [json.loads(x) for x in (tiny_run / "evals.jsonl").read_text().splitlines()]
    assert {(e["stage"], e["level"], e["metric"]) for e in evals} >= {("sft", "L1", "format"), ("sft", "L2", "exact_match")}
    m = _metrics(tiny_run, "sft")
    assert any("phase/update/flops_per_s" in r for r in m)


def test_a_loaded_start_is_evaluated_before_the_first_stage(tiny_run, tmp_path):
    """A run from a model folder records the start's evals as stage "base" (the "before" of its gains),
    equal to the previous run's evals of that same checkpoint."""
    from posttrain.report import write_report

    start = tiny_run / "checkpoints" / "sft" / "final"
    d = tiny_recipe_dict(model={"init": str(start)})
    d["stages"] = [d["stages"][1]]
    d["stages"][0]["steps"] = 2
    out = tmp_path / "from-sft"
    run_pipeline(Recipe.model_validate(d), out)
    evals = [json.loads(x) for x in (out / "evals.jsonl").read_text().splitlines()]
    assert [e["stage"] for e in evals[:1]] == ["base"] and {e["stage"] for e in evals} == {"base", "sft"}
    earlier = {(e["level"], e["metric"]): e["value"] for e in map(json.loads, (tiny_run / "evals.jsonl").read_text().splitlines())
               if e["stage"] == "sft"}
    base = {(e["level"], e["metric"]): e["value"] for e in evals if e["stage"] == "base"}
    assert base == earlier
    write_report(out)  # a base stage with evals and an eval phase but no training renders


def test_fused_adamw_by_model_size():
    from posttrain.runtime.config import OptimConfig
    from posttrain.stages._training import FUSED_MIN_PARAMETERS, build_optimizer

    big, small = torch.nn.Linear(4096, FUSED_MIN_PARAMETERS // 4096 + 1), torch.nn.Linear(64, 64)
    assert build_optimizer(big, OptimConfig()).defaults["fused"]
    assert not build_optimizer(small, OptimConfig()).defaults["fused"]
    assert build_optimizer(small, OptimConfig(fused=True)).defaults["fused"]
    assert not build_optimizer(big, OptimConfig(fused=False)).defaults["fused"]


@pytest.mark.parametrize("case", ["under", "at the limit", "just over", "over", "nan"])
def test_optimizer_step_clips_exactly_as_clip_grad_norm(case):
    """The gradients reach the optimizer bitwise as `clip_grad_norm_` leaves them, whether the multiply
    is skipped (factor min(1, 1 / (norm + 1e-6)) = 1) or not; a parameter without a gradient is left out."""
    torch.manual_seed(0)
    ref, model = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
    model.load_state_dict(ref.state_dict())
    g = torch.randn(16, 8)
    # the weight's gradient alone sets the norm (the bias has none): scaled to the case's norm
    target = {"under": 1e-3, "at the limit": 1.0, "just over": 1.0 + 1e-3, "over": 1e3, "nan": 1.0}[case]
    g = g * (target / g.norm())
    if case == "nan":
        g[0, 0] = float("nan")
    ref.weight.grad, model.weight.grad = g.clone(), g.clone()
    ref.bias.grad = model.bias.grad = None
    expected_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    seen: list[torch.Tensor] = []
    optimizer = SimpleNamespace(step=lambda: seen.append(model.weight.grad.clone()), zero_grad=lambda set_to_none: None)
    t = Trainer(model, optimizer, SimpleNamespace(step=lambda: None), step=0, data_state=None)
    norm = optimizer_step(t, OptimConfig(lr=1e-3, grad_clip=1.0))
    assert norm == pytest.approx(expected_norm, rel=1e-6, nan_ok=True)
    if case == "nan":                                                  # NaN norm: the guard skips the step
        assert seen == [] and t.guard.reason == "gradient norm = nan at step 1"
    else:
        assert torch.equal(seen[0], ref.weight.grad)
    if case == "over":
        assert seen[0].norm() == pytest.approx(1.0, rel=1e-5)        # 1e3 → 1: scaled by ~1e-3
    assert t.step == 1
