"""The weights' bf16 copies (`models/weight_copies.py`): written by our AdamW's step, read by the fused MLP and the
fused attention's projections under bf16 autocast — logits and gradients bit-identical to casting each weight
again, and the projections' node to autocast's own linear — and dropped from use the moment the weight changes any
other way."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.models import build_tiny, fused_attention, fused_mlp, fused_norm, weight_copies
from posttrain.native import adamw
from posttrain.stages._adamw import AdamW

pytestmark = pytest.mark.usefixtures("one_thread")


def _fused_tiny():
    model = build_tiny("tiny-1m", vocab_size=64, seed=3)
    fused_norm.install(model)
    assert fused_mlp.install(model) == len(model.model.layers)
    assert fused_attention.install(model) == len(model.model.layers)
    return model


def _forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids, use_cache=False).logits
    logits.float().logsumexp(-1).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_fused_modules_mark_their_projections():
    model = _fused_tiny()
    marked = {n for n, p in model.named_parameters() if weight_copies.wanted(p)}
    layer = {f"{m}.{p}.weight" for m, ps in (("mlp", ("gate_proj", "up_proj", "down_proj")),
                                             ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"))) for p in ps}
    assert marked == {f"model.layers.{i}.{name}" for i in range(len(model.model.layers)) for name in layer}


def test_the_forward_reads_the_copies_and_computes_what_the_casts_compute(monkeypatch):
    if adamw.library() is None:
        pytest.skip("no C compiler")
    model = _fused_tiny()
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    opt = AdamW(model.parameters(), lr=1e-2)
    _forward_backward(model, ids)
    opt.step()  # writes the copies
    marked = [p for p in model.parameters() if weight_copies.wanted(p)]
    assert all(torch.equal(weight_copies.fresh(p, torch.bfloat16), p.detach().to(torch.bfloat16)) for p in marked)
    read = []
    real = weight_copies.fresh
    monkeypatch.setattr(weight_copies, "fresh", lambda w, d: (read.append(w) or True) and real(w, d))
    with_copies = _forward_backward(model, ids)
    assert {id(p) for p in read} == {id(p) for p in marked}
    without = copy.deepcopy(model)
    for p in without.parameters():
        weight_copies.drop(p)
    casts = _forward_backward(without, ids)
    assert torch.equal(with_copies[0], casts[0])
    for name, grad in casts[1].items():  # one node either way: a run resumed without its copies goes on bitwise
        assert torch.equal(with_copies[1][name], grad), name


def test_the_projections_node_computes_what_autocast_computes(monkeypatch):
    """The attention's projections as `weight_copies.linear`'s node against the same model with them run as plain
    linears under autocast: logits and every gradient bit-identical (the same casts and matmuls)."""
    ours = _fused_tiny()
    theirs = copy.deepcopy(ours)
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    l0, g0 = _forward_backward(ours, ids)
    monkeypatch.setattr(weight_copies, "linear", lambda module, x: module(x))
    l1, g1 = _forward_backward(theirs, ids)
    assert torch.equal(l0, l1)
    assert all(torch.equal(g0[name], g1[name]) for name in g0)


def test_a_weight_changed_any_other_way_is_cast_again():
    w = torch.nn.Parameter(torch.randn(8, 8))
    weight_copies.store(w, w.detach().to(torch.bfloat16))
    assert weight_copies.fresh(w, torch.bfloat16) is not None
    assert weight_copies.fresh(w, torch.float16) is None  # another dtype
    with torch.no_grad():
        w.mul_(2)  # any in-place change through PyTorch moves the version
    assert weight_copies.fresh(w, torch.bfloat16) is None
    assert torch.equal(weight_copies.cast(w, torch.bfloat16), w.detach().to(torch.bfloat16))
    weight_copies.store(w, w.detach().to(torch.bfloat16))
    w.data = torch.randn(8, 8)  # a new storage
    assert weight_copies.fresh(w, torch.bfloat16) is None
    weight_copies.store(w, w.detach().to(torch.bfloat16))
    m = torch.nn.Linear(8, 8, bias=False)
    weight_copies.store(m.weight, m.weight.detach().to(torch.bfloat16))
    m.load_state_dict({"weight": torch.zeros(8, 8)})
    assert weight_copies.fresh(m.weight, torch.bfloat16) is None


def test_outside_autocast_or_autograd_the_module_runs_itself():
    m = torch.nn.Linear(8, 4, bias=False)
    weight_copies.store(m.weight, torch.zeros(4, 8, dtype=torch.bfloat16))  # a wrong copy, to see whether it is read
    x = torch.randn(3, 8)
    assert torch.equal(weight_copies.linear(m, x), m(x))  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert torch.equal(weight_copies.linear(m, x), m(x))  # no autograd
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.count_nonzero(weight_copies.linear(m, x)) == 0  # the copy is read
        weight_copies.drop(m.weight)
        assert torch.equal(weight_copies.linear(m, x), m(x))  # or the weight cast, as autocast casts it


def test_a_lora_runs_frozen_weights_keep_their_first_cast(policy_dir):
    """LoRA (q and v adapted): the base weights under the adapters and the layers left alone are frozen, so the first
    training forward's casts are kept and the second reads them — logits and gradients bit-identical to casting
    again; a weight set to train, or loaded, is cast again."""
    from posttrain.models import load_model, lora

    torch.manual_seed(0)
    model = lora.wrap(load_model(policy_dir, autocast_dtype=torch.bfloat16),
                      r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"], base=policy_dir)
    with torch.no_grad():
        for p in lora.adapter_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    first = _forward_backward(model, ids)
    kept = {n: p for n, p in model.named_parameters() if weight_copies.fresh(p, torch.bfloat16) is not None}
    layers = model.config.num_hidden_layers
    assert len(kept) == 7 * layers and not any(p.requires_grad for p in kept.values())  # every frozen projection
    second = _forward_backward(model, ids)  # reads the kept casts
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(first[1][n], second[1][n]) for n in first[1])
    name, weight = next(iter(kept.items()))
    weight.requires_grad_(True)
    assert weight_copies.fresh(weight, torch.bfloat16) is None, name
    weight.requires_grad_(False)
    other = next(p for n, p in kept.items() if n != name)
    with torch.no_grad():
        other.copy_(other + 1)
    assert weight_copies.fresh(other, torch.bfloat16) is None
