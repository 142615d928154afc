"""The gated MLP's elementwise forward and backward in C (`native/swiglu.py`, `native/kernels/swiglu.c`) against float64,
both builds (the AVX-512 code where the CPU has it, the plain-C loop always), and its place in
`fused_mlp._GatedMLP` and `_SiluMul`: taken for bf16, the same gradients as the PyTorch ops within bf16
round-off, the PyTorch ops where it is off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.models import fused_mlp
from posttrain.native import swiglu

pytestmark = pytest.mark.usefixtures("one_thread")
BF16_ROUNDING = 2 ** -8


KERNEL = swiglu  # the `lib` fixture (conftest.py) builds its library both ways


def _case(shape=(5, 7, 83), seed=0):  # 83: a row that is not a multiple of the vector width
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * 4).bfloat16()
    return gate, torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()


def _reference(gate, up, grad):
    g, u, d = gate.double(), up.double(), grad.double()
    s = torch.sigmoid(g)
    act = (g * s).bfloat16().double()  # the forward's activation, rounded to bf16
    return act * u, d * u * s * (1 + g * (1 - s)), d * act


def test_the_three_results_are_float64_rounded_once(lib):
    gate, up, grad = _case()
    prod, grad_gate, grad_up = swiglu.backward(lib, gate, up, grad)
    for got, ref in zip((prod, grad_gate, grad_up), _reference(gate, up, grad), strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == gate.shape
        torch.testing.assert_close(got.double(), ref, rtol=BF16_ROUNDING, atol=1e-30)


def test_the_product_and_the_gradient_through_up_are_pytorchs_exactly(lib):
    """Both are one product of bf16 values rounded once, as PyTorch's ops compute them."""
    gate, up, grad = _case(seed=1)
    prod, _, grad_up = swiglu.backward(lib, gate, up, grad)
    act = F.silu(gate)
    assert torch.equal(prod, act * up)
    assert torch.equal(grad_up, grad * act)


def test_the_forward_product_is_pytorchs_bit_for_bit(lib):
    """One pass for `F.silu(gate) * up`, rounded as those two ops round: equal on a million elements of
    gates spread over ±16 (most of silu's curve and both of its tails), on odd lengths and at the extremes."""
    g = torch.Generator().manual_seed(5)
    gate = (torch.randn(977, 1031, generator=g) * 4).bfloat16()
    up = torch.randn(977, 1031, generator=g).bfloat16()
    assert torch.equal(swiglu.product(lib, gate, up), F.silu(gate) * up)
    extreme = torch.tensor([0.0, -0.0, 100.0, -100.0, 3e37, -3e37, 1e-30, -87.0, float("inf")], dtype=torch.bfloat16)
    assert torch.equal(swiglu.product(lib, extreme, torch.full_like(extreme, -1.5)),
                       F.silu(extreme) * torch.full_like(extreme, -1.5))
    # the one departure: below −87.3, where e^g leaves fp32's normal range, the kernel's silu is 0 and
    # PyTorch's (g / (1 + e^−g)) a value under 1e-36 in magnitude
    tail = torch.tensor([-88.0], dtype=torch.bfloat16)
    assert swiglu.product(lib, tail, torch.ones_like(tail)).item() == 0.0
    assert 0 < -F.silu(tail).item() < 1e-36
    nan = swiglu.product(lib, torch.tensor([float("nan"), float("-inf")], dtype=torch.bfloat16),
                         torch.ones(2, dtype=torch.bfloat16))
    assert torch.isnan(nan).all()  # a NaN gate stays NaN, and silu(−inf) = −inf · 0 is NaN, as in PyTorch


def test_extreme_gates_and_no_product(lib):
    gate = torch.tensor([0.0, -0.0, 100.0, -100.0, 3e37, -3e37, 1e-30, -88.0], dtype=torch.bfloat16)
    up, grad = torch.ones_like(gate), torch.full_like(gate, 2.0)
    prod, grad_gate, grad_up = swiglu.backward(lib, gate, up, grad, product=False)
    assert prod is None
    assert torch.all(torch.isfinite(grad_gate.float())) and torch.all(torch.isfinite(grad_up.float()))
    # silu'(0) = 1/2; far right silu' = 1 (silu = x); far left silu, silu' → 0
    torch.testing.assert_close(grad_gate.float(), torch.tensor([1, 1, 2, 0, 2, 0, 1, 0], dtype=torch.float),
                               rtol=BF16_ROUNDING, atol=1e-30)
    torch.testing.assert_close(grad_up.float()[:4], torch.tensor([0, 0, 200, 0], dtype=torch.float),
                               rtol=BF16_ROUNDING, atol=1e-30)


def test_both_builds_agree(lib):
    other = swiglu.library(generic=True)
    gate, up, grad = _case((3, 1001), seed=2)
    for a, b in zip(swiglu.backward(lib, gate, up, grad), swiglu.backward(other, gate, up, grad), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=BF16_ROUNDING, atol=1e-30)


def _grads(x, weights, dtype):
    x = x.clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in weights]
    fused_mlp.gated_mlp(x, *ws, dtype).square().sum().backward()
    return [x.grad, *(w.grad for w in ws)]


def _mlp_case(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An input (2, 9, 16) and gate, up, down weights for an MLP of width 40."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 9, 16, generator=gen)
    return x, [0.3 * torch.randn(40, 16, generator=gen), 0.3 * torch.randn(40, 16, generator=gen),
               0.3 * torch.randn(16, 40, generator=gen)]


def _count_calls(monkeypatch, name: str) -> list[int]:
    """Wrap `swiglu.<name>` so that each call appends to the returned list."""
    calls: list[int] = []
    real = getattr(swiglu, name)
    monkeypatch.setattr(swiglu, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_the_mlp_backward_takes_the_kernel_and_agrees_with_pytorch(monkeypatch):
    if swiglu.library() is None:
        pytest.skip("no C compiler")
    x, weights = _mlp_case(3)
    calls = _count_calls(monkeypatch, "backward")
    ours = _grads(x, weights, torch.bfloat16)
    assert calls, "the bf16 backward did not take the kernel"
    monkeypatch.setattr(swiglu, "usable", lambda *a: None)
    theirs = _grads(x, weights, torch.bfloat16)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert (a - b).norm() / b.norm() < 1e-2  # bf16 round-off: the kernel keeps grad ⊙ up in fp32
    exact = _grads(x.double(), [w.double() for w in weights], torch.double)
    for a, b in zip(ours, exact, strict=True):
        assert (a.double() - b).norm() / b.norm() < 3e-2


def test_the_mlp_forward_takes_the_kernel_and_is_pytorchs(monkeypatch):
    if swiglu.library() is None:
        pytest.skip("no C compiler")
    x, weights = _mlp_case(6)
    calls = _count_calls(monkeypatch, "product")
    with torch.no_grad():
        ours = fused_mlp.gated_mlp(x, *weights, torch.bfloat16)
        assert calls, "the bf16 forward did not take the kernel"
        monkeypatch.setattr(swiglu, "usable", lambda *a: None)
        assert torch.equal(ours, fused_mlp.gated_mlp(x, *weights, torch.bfloat16))


def test_the_product_node_takes_it_too(monkeypatch):
    if swiglu.library() is None:
        pytest.skip("no C compiler")
    gate, up, grad = _case(seed=4)
    gate.requires_grad_(True), up.requires_grad_(True)
    fused_mlp.silu_mul(gate, up).backward(grad)
    _, grad_gate, grad_up = swiglu.backward(swiglu.library(), gate.detach(), up.detach(), grad, product=False)
    assert torch.equal(gate.grad, grad_gate) and torch.equal(up.grad, grad_up)


def test_tensors_it_does_not_take_go_through_pytorch():
    if swiglu.library() is None:
        pytest.skip("no C compiler")
    gate, up, _ = _case()
    assert swiglu.usable(gate, up) is not None
    assert swiglu.usable(gate.float(), up.float()) is None           # fp32: the PyTorch ops
    assert swiglu.usable(gate.transpose(0, 1), up.transpose(0, 1)) is None  # not contiguous
    assert swiglu.usable(gate, up[:1]) is None                      # shapes differ
    with pytest.raises(ValueError, match="grad of shape"):
        swiglu.backward(swiglu.library(), gate, up, up[:1])
