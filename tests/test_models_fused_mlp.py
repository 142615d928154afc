"""The fused gated MLP of the training forward against `transformers`' own: forward bit-identical under
autocast, gradients equal in float64 and within bf16 round-off under autocast, fewer bytes kept for the
backward; MLPs it does not reproduce, and forwards outside autocast or autograd, are left alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models import build_tiny, fused_mlp, fused_norm, load_model
from posttrain.models import lora as lora_mod

pytestmark = pytest.mark.usefixtures("one_thread")


def naive(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def f64(*shape, gen, scale=0.3):
    return (scale * torch.randn(*shape, dtype=torch.float64, generator=gen)).requires_grad_(True)


def test_gradients_equal_in_float64():
    gen = torch.Generator().manual_seed(1)
    x, wg, wu, wd = f64(2, 5, 8, gen=gen, scale=1.0), f64(12, 8, gen=gen), f64(12, 8, gen=gen), f64(8, 12, gen=gen)
    g = torch.randn(2, 5, 8, dtype=torch.float64, generator=gen)
    (naive(x, wg, wu, wd) * g).sum().backward()
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    y = fused_mlp.gated_mlp(*leaves)
    assert torch.allclose(y, naive(x, wg, wu, wd), rtol=0, atol=1e-14)
    (y * g).sum().backward()
    for ours, theirs in zip(leaves, (x, wg, wu, wd), strict=True):
        assert torch.allclose(ours.grad, theirs.grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(fused_mlp.gated_mlp, tuple(t.detach().requires_grad_(True) for t in leaves))


def test_silu_mul_gradients():
    gen = torch.Generator().manual_seed(2)
    gate, up = f64(3, 7, gen=gen, scale=2.0), f64(3, 7, gen=gen, scale=2.0)
    assert torch.allclose(fused_mlp.silu_mul(gate, up), F.silu(gate) * up, rtol=0, atol=0)
    assert torch.autograd.gradcheck(fused_mlp.silu_mul, (gate, up))


def test_frozen_weights_get_no_gradient():
    """LoRA on the attention only: the MLP's weights are frozen, its input still needs a gradient."""
    x = torch.randn(4, 8, requires_grad=True)
    w = [torch.randn(12, 8), torch.randn(12, 8), torch.randn(8, 12)]
    fused_mlp.gated_mlp(x, *w).sum().backward()
    assert x.grad is not None and all(t.grad is None for t in w)
    x2 = torch.randn(4, 8)
    wd = torch.randn(8, 12, requires_grad=True)
    fused_mlp.gated_mlp(x2, w[0], w[1], wd).sum().backward()  # only the down projection trains
    assert wd.grad is not None and wd.grad.shape == wd.shape


def train_grads(model, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).sum().backward()
    params = [p for p in model.parameters() if p.requires_grad]
    return logits.detach(), torch.cat([p.grad.flatten() for p in params])


def test_whole_model_under_bf16_autocast():
    """Logits bit-identical to the unfused model's; every gradient within bf16 round-off of its own."""
    ref = build_tiny("tiny-1m", vocab_size=64, seed=3)
    fused_norm.install(ref)
    ours = copy.deepcopy(ref)
    assert fused_mlp.install(ours) == 4  # one per layer
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    (l0, g0), (l1, g1) = train_grads(ref, ids), train_grads(ours, ids)
    assert torch.equal(l0, l1)
    rel = (g1 - g0).norm() / g0.norm()
    assert rel < 1e-2, rel  # the same kernels: equal on this machine; bf16 round-off where a layout differs


def test_keeps_fewer_bytes_for_the_backward():
    """What it is for: the bytes autograd keeps for the backward of a forward, the two MLPs side by side."""
    ref = build_tiny("tiny-1m", vocab_size=64, seed=3)
    ours = copy.deepcopy(ref)
    fused_mlp.install(ours)
    ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))

    def saved_bytes(model) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids)
        return total

    layers, tokens = len(ref.model.layers), ids.numel()
    inter = ref.config.intermediate_size
    saved_ref, saved_ours = saved_bytes(ref), saved_bytes(ours)
    # two intermediate-width bf16 tensors per token and layer fewer: silu(gate) and the product
    assert saved_ref - saved_ours >= 2 * 2 * inter * tokens * layers * 0.99, (saved_ref, saved_ours)


def test_outside_autocast_or_autograd_the_module_forward_runs():
    model = build_tiny("tiny-1m", vocab_size=64, seed=3)
    fused_mlp.install(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 3, model.config.hidden_size, requires_grad=True)
    assert type(mlp(x).grad_fn).__name__ != "_GatedMLPBackward"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(mlp(x).grad_fn).__name__ == "_GatedMLPBackward"
        with torch.no_grad():
            assert mlp(x).dtype == torch.bfloat16  # the module's own forward under autocast


class GeluMLP(nn.Module):
    def __init__(self, d=8, i=12):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False), nn.Linear(i, d, bias=False)
        self.act_fn = nn.GELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SiluMLP(GeluMLP):
    def __init__(self, bias=False):
        super().__init__()
        self.act_fn = nn.SiLU()
        if bias:
            self.up_proj = nn.Linear(8, 12, bias=True)


def test_an_mlp_it_does_not_reproduce_is_left_alone():
    model = nn.ModuleList([GeluMLP(), SiluMLP(bias=True), SiluMLP()])
    assert fused_mlp.install(model) == 1
    assert [fused_mlp.is_fused(m) for m in model] == [False, False, True]
    assert fused_mlp.install(model) == 0  # idempotent


def test_lora_projections_take_the_product_node():
    """Adapters wrap the projections: the fused SiLU·up node only, logits still bit-identical."""
    base = build_tiny("tiny-1m", vocab_size=64, seed=3)
    ref = lora_mod.wrap(copy.deepcopy(base), r=4, alpha=8, dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"])
    fused = copy.deepcopy(base)
    assert fused_mlp.install(fused) == 4
    ours = lora_mod.wrap(fused, r=4, alpha=8, dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"])
    with torch.no_grad():  # the same adapter weights (B is zero at init: make it not)
        for (_, p0), (_, p1) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
            if p0.requires_grad:
                p0.normal_(0, 0.05)
                p1.copy_(p0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    (l0, g0), (l1, g1) = train_grads(ref, ids), train_grads(ours, ids)
    assert torch.equal(l0, l1)
    assert (g1 - g0).norm() / g0.norm() < 1e-2


def test_load_model_fuses_only_for_autocast(tmp_path):
    build_tiny("tiny-1m", vocab_size=64).save_pretrained(tmp_path)
    trained = load_model(tmp_path, autocast_dtype=torch.bfloat16)
    plain = load_model(tmp_path)
    assert sum(map(fused_mlp.is_fused, trained.modules())) == 4
    assert sum(map(fused_mlp.is_fused, plain.modules())) == 0
    trained.eval()
    trained.train()  # the subclass survives transformers' re-kernelize on train()/eval()
    assert sum(map(fused_mlp.is_fused, trained.modules())) == 4
