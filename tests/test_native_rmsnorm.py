"""The fused RMSNorm in C (`native/rmsnorm.py`, `native/kernels/rmsnorm.c`), both builds: its forward's scaling
and cast bit-identical to the PyTorch ops, its backward against float64 for a bf16 and an fp32 incoming gradient,
and their place in `fused_norm._RMSNorm`: taken for fp32 rows on a CPU, the same gradients as the PyTorch ops
within fp32 round-off, the PyTorch ops where it is off."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import fused_norm
from posttrain.native import rmsnorm

pytestmark = pytest.mark.usefixtures("one_thread")
FP32 = 1e-6  # relative, over a whole tensor


KERNEL = rmsnorm  # the `lib` fixture (conftest.py) builds its library both ways


def _case(rows=(3, 37), d=83, grad_dtype=torch.bfloat16, seed=0):  # 83: not a multiple of a vector width
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, d, generator=g) * 3
    w = 1 + 0.1 * torch.randn(d, generator=g)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return x, w, rstd, torch.randn(*rows, d, generator=g).to(grad_dtype)


def _reference(x, w, rstd, grad):
    x, w, rstd, grad = (t.double() for t in (x, w, rstd, grad))
    x_hat, g = x * rstd, grad * w
    return (g - x_hat * (g * x_hat).mean(-1, keepdim=True)) * rstd, (grad * x_hat).reshape(-1, x.shape[-1]).sum(0)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_both_gradients_are_float64s_within_fp32_round_off(lib, grad_dtype):
    x, w, rstd, grad = _case(grad_dtype=grad_dtype)
    grad_x, grad_w = rmsnorm.backward(lib, x, w, rstd, grad)
    ref_x, ref_w = _reference(x, w, rstd, grad)
    assert grad_x.dtype == grad_w.dtype == torch.float32 and grad_x.shape == x.shape and grad_w.shape == w.shape
    assert _rel(grad_x, ref_x) < FP32 and _rel(grad_w, ref_w) < FP32


def test_either_gradient_alone(lib):
    x, w, rstd, grad = _case(seed=1)
    both = rmsnorm.backward(lib, x, w, rstd, grad)
    only_x = rmsnorm.backward(lib, x, w, rstd, grad, need_w=False)
    only_w = rmsnorm.backward(lib, x, w, rstd, grad, need_x=False)
    assert only_x[1] is None and only_w[0] is None
    assert torch.equal(only_x[0], both[0]) and torch.equal(only_w[1], both[1])


def test_threads_split_the_rows_and_the_weight_sums_agree(lib):
    x, w, rstd, grad = _case(rows=(4, 501), d=64, seed=2)
    one = rmsnorm.backward(lib, x, w, rstd, grad)
    torch.set_num_threads(2)
    two = rmsnorm.backward(lib, x, w, rstd, grad)
    assert torch.equal(one[0], two[0])           # rows are independent
    assert _rel(two[1], one[1].double()) < FP32  # the column sums, added per thread in fp64


def test_the_norm_backward_takes_the_kernel_and_agrees_with_pytorch(monkeypatch):
    if rmsnorm.library() is None:
        pytest.skip("no C compiler")
    x, w, _, grad = _case(seed=3)

    def grads():
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        fused_norm.rms_norm(xx, ww, 1e-5, torch.bfloat16).backward(grad)
        return xx.grad, ww.grad

    calls = []
    real = rmsnorm.backward
    monkeypatch.setattr(rmsnorm, "backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    ours = grads()
    assert calls, "the fp32 norm backward did not take the kernel"
    monkeypatch.setattr(rmsnorm, "usable", lambda *a: None)
    theirs = grads()
    ref_x, ref_w = _reference(x, w, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), grad)
    for a, b, ref in zip(ours, theirs, (ref_x, ref_w), strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert _rel(a, ref) < FP32 and _rel(b, ref) < FP32


def test_inputs_it_does_not_take_go_through_pytorch():
    if rmsnorm.library() is None:
        pytest.skip("no C compiler")
    x, w, rstd, grad = _case()
    assert rmsnorm.usable(x, w, rstd, grad) is not None
    assert rmsnorm.usable(x.double(), w.double(), rstd.double(), grad.double()) is None  # float64: the PyTorch ops
    assert rmsnorm.usable(x, w, rstd, grad.half()) is None
    assert rmsnorm.usable(x, w[:-1], rstd, grad) is None
    assert rmsnorm.usable(x, w, rstd, grad[:1]) is None


def test_the_forward_scaling_is_the_pytorch_ops_exactly(lib):
    x, w, rstd, _ = _case(seed=5)
    assert torch.equal(rmsnorm.scale(lib, x, w, rstd), (w * (x * rstd)).to(torch.bfloat16))


def test_the_norm_forward_takes_it_and_the_logits_path_is_unchanged(monkeypatch):
    if rmsnorm.library() is None:
        pytest.skip("no C compiler")
    x, w, _, _ = _case(seed=6)
    calls = []
    real = rmsnorm.scale
    monkeypatch.setattr(rmsnorm, "scale", lambda *a: calls.append(1) or real(*a))
    ours = fused_norm.rms_norm(x, w, 1e-5, torch.bfloat16)
    assert calls == [1]
    monkeypatch.setattr(rmsnorm, "usable_forward", lambda *a: None)
    assert torch.equal(ours, fused_norm.rms_norm(x, w, 1e-5, torch.bfloat16))
    assert fused_norm.rms_norm(x, w, 1e-5).dtype == torch.float32  # an fp32 output: the PyTorch ops
    assert calls == [1]


def test_forward_inputs_it_does_not_take():
    if rmsnorm.library() is None:
        pytest.skip("no C compiler")
    x, w, rstd, _ = _case()
    assert rmsnorm.usable_forward(x, w, rstd, torch.bfloat16) is not None
    assert rmsnorm.usable_forward(x, w, rstd, torch.float16) is None             # another output dtype
    assert rmsnorm.usable_forward(x.bfloat16(), w, rstd, torch.bfloat16) is None  # bf16 rows (Qwen3's q/k norms)
    assert rmsnorm.usable_forward(x, w[:5], rstd, torch.bfloat16) is None         # a weight of another width
