"""A LoRA-adapted linear as one autograd node under autocast (`models/fused_lora.py`): the node against the
formula (fp64 gradcheck, a bias, a base weight that trains), a whole adapted model's logits and adapter
gradients against PEFT's own forward in bf16, and where PEFT's forward still runs (fp32, dropout, adapters
disabled, a merged layer)."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import fused_lora, load_model, lora

pytestmark = pytest.mark.usefixtures("one_thread")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapted(policy_dir, **over):
    torch.manual_seed(0)
    model = lora.wrap(load_model(policy_dir, autocast_dtype=torch.bfloat16),
                      **{"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ALL, **over}, base=policy_dir)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B starts at 0 (the adapter a no-op); give both factors values
        for p in lora.adapter_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_the_node_is_the_formula_in_fp64():
    gen = torch.Generator().manual_seed(0)
    x, w, bias = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((2, 3, 6), (5, 6), (5,)))
    a, b = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((2, 6), (5, 2)))
    for t in (x, w, bias, a, b):
        t.requires_grad_()
    y = fused_lora.lora_linear(x, w, bias, a, b, 1.5)
    torch.testing.assert_close(y, x @ w.T + bias + 1.5 * (x @ a.T) @ b.T)
    assert torch.autograd.gradcheck(lambda *t: fused_lora.lora_linear(*t, 1.5), (x, w, bias, a, b))
    assert torch.autograd.gradcheck(lambda x, a, b: fused_lora.lora_linear(x, w.detach(), None, a, b, 0.5), (x, a, b))


def test_every_adapted_linear_is_switched_and_peft_still_sees_its_layer(policy_dir):
    from peft.tuners.lora import Linear

    model = _adapted(policy_dir)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(fused_lora.is_fused(m) for m in layers)
    assert fused_lora.install(model) == 0  # idempotent


def _step(model, ids, *, fused: bool, monkeypatch):
    """bf16 logits and every adapter's gradient of one forward + backward, through the node or PEFT's forward."""
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(fused_lora, "_vanilla", lambda self: None)
        calls = []
        apply = fused_lora._LoraLinear.apply
        m.setattr(fused_lora._LoraLinear, "apply", lambda *a: calls.append(1) or apply(*a))
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
    grads = {n: p.grad.clone() for n, p in lora.adapter_parameters(model).items()}
    return logits.detach().float(), grads, len(calls)


def test_an_adapted_model_matches_peft_to_bf16_round_off(policy_dir, monkeypatch):
    model = _adapted(policy_dir)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    ours, our_grads, n_ours = _step(model, ids, fused=True, monkeypatch=monkeypatch)
    theirs, their_grads, n_theirs = _step(model, ids, fused=False, monkeypatch=monkeypatch)
    layers = sum(1 for m in model.modules() if fused_lora.is_fused(m))
    assert n_ours == layers and n_theirs == 0
    assert (ours - theirs).abs().max() <= 0.03 * theirs.abs().max()  # bf16 round-off through every layer: 0.007 measured
    for name, g in their_grads.items():
        err = (our_grads[name] - g).norm() / g.norm()
        assert err < 0.05, (name, err.item())  # measured ≤ 0.022; a scaling 10% off: 0.27


def test_peft_forward_runs_where_the_node_does_not_apply(policy_dir, monkeypatch):
    calls = []
    apply = fused_lora._LoraLinear.apply
    monkeypatch.setattr(fused_lora._LoraLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    ids = torch.randint(3, 200, (1, 8))
    model = _adapted(policy_dir)
    model(input_ids=ids)                                   # fp32: no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16), lora.adapters_disabled(model):
        model(input_ids=ids)                               # the reference: base weights only
    assert calls == []
    dropped = _adapted(policy_dir, dropout=0.1).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dropped(input_ids=ids)                             # dropout on the adapter's input: PEFT's own
        assert calls == []
        dropped.eval()(input_ids=ids)                      # in eval, dropout is the identity: the node
    assert calls
