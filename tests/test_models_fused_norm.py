"""The fused RMSNorm of the training forward against `transformers`' own norm: forward bit-identical, gradients
equal in float64 and within bf16 round-off under autocast; norms it does not reproduce are left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from posttrain.models import build_tiny, fused_norm, load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def norm_module(d: int = 16, eps: float = 1e-5, seed: int = 0) -> LlamaRMSNorm:
    m = LlamaRMSNorm(d, eps=eps)
    with torch.no_grad():
        m.weight.copy_(1 + 0.2 * torch.randn(d, generator=torch.Generator().manual_seed(seed)))
    return m


def test_hand_computed_row():
    # x = (3, 4): mean(x²) = (9 + 16) / 2 = 12.5, rstd = 1/√12.5 = 0.282843 → (0.848528, 1.131371); × w (2, 1)
    y = fused_norm.rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([2.0, 1.0]), 0.0)
    assert torch.allclose(y, torch.tensor([[1.697056, 1.131371]]), atol=1e-6)


def test_forward_bit_identical_under_autocast_and_outside():
    ref, ours = norm_module(), norm_module()
    assert fused_norm.install(ours) == 1
    x = torch.randn(2, 7, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(x)
        theirs = ref(x)  # fp32: the linear that reads it casts to bf16
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, theirs.to(torch.bfloat16))
    assert torch.equal(ours(x), ref(x)) and ours(x).dtype == torch.float32  # no autocast: the module's own forward


def test_gradients_equal_in_float64():
    """Against the naive formula under autograd (`transformers`' own norm computes in fp32 whatever its input)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = (1 + 0.2 * torch.randn(16, dtype=torch.float64, generator=gen)).requires_grad_(True)
    g = torch.randn(3, 5, 16, dtype=torch.float64, generator=gen)
    (w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    (fused_norm.rms_norm(x2, w2, 1e-5) * g).sum().backward()
    assert torch.allclose(x2.grad, x.grad, rtol=0, atol=1e-12)
    assert torch.allclose(w2.grad, w.grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: fused_norm.rms_norm(a, b, 1e-5), (x2.detach().requires_grad_(), w2))


def test_frozen_weight_gets_no_gradient():
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.ones(16)
    fused_norm.rms_norm(x, w, 1e-5).sum().backward()
    assert x.grad is not None and w.grad is None


def test_whole_model_under_bf16_autocast():
    """Logits bit-identical to the unfused model's; every gradient within bf16 round-off of its own."""
    ref = build_tiny("tiny-1m", vocab_size=64, seed=3)
    ours = copy.deepcopy(ref)
    assert fused_norm.install(ours) == 2 * 4 + 1  # two per layer and the final norm
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    grads = []
    for m in (ref, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        grads.append((logits.detach(), torch.cat([p.grad.flatten() for p in m.parameters()])))
    assert torch.equal(grads[0][0], grads[1][0])
    rel = (grads[1][1] - grads[0][1]).norm() / grads[0][1].norm()
    assert rel < 2e-2, rel  # bf16 round-off of a different backward order (measured ≈ 5e-3)


class GemmaLikeRMSNorm(nn.Module):
    """`(1 + weight)` scaling: not the Llama norm, so not replaced."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def test_a_norm_it_does_not_reproduce_is_left_alone():
    model = nn.Sequential(GemmaLikeRMSNorm(16), norm_module())
    assert fused_norm.install(model) == 1  # only the Llama one
    assert not fused_norm.is_fused(model[0]) and fused_norm.is_fused(model[1])
    assert fused_norm.install(model) == 0  # idempotent


def test_load_model_fuses_only_for_autocast(tmp_path):
    build_tiny("tiny-1m", vocab_size=64).save_pretrained(tmp_path)
    trained = load_model(tmp_path, autocast_dtype=torch.bfloat16)
    plain = load_model(tmp_path)
    assert sum(map(fused_norm.is_fused, trained.modules())) == 9
    assert sum(map(fused_norm.is_fused, plain.modules())) == 0


def test_survives_train_and_eval():
    """transformers re-kernelizes its hub-decorated norms on train()/eval(), dropping forwards set on an instance."""
    model = build_tiny("tiny-1m", vocab_size=64)
    fused_norm.install(model)
    model.train()
    model.eval()
    model.train()
    x = torch.randn(2, 3, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.model.norm(x).dtype == torch.bfloat16  # the fused forward ran
