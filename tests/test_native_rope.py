"""The rotary embedding in C (`native/rope.py`, `native/kernels/rope.c`), both builds (the vector code the compiler
makes for this CPU, the plain loops): its forward bit-identical to `transformers`' `apply_rotary_pos_emb`, its
backward float64's rounded once to bf16; the inputs it refuses; the fallback when it cannot be built."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from posttrain.native import rope

pytestmark = pytest.mark.usefixtures("one_thread")
BF16_ROUNDING = 2 ** -8


KERNEL = rope  # the `lib` fixture (conftest.py) builds its library both ways


def _case(batch=2, tokens=37, heads=3, d=64, angle_batch=None, seed=0):
    """A projection's output (B, T, H·D) bf16 and the rotary angles' cos, sin (B or 1, T, D) fp32, as transformers
    makes them (each half of D the same frequencies)."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(batch, tokens, heads * d, generator=g)).bfloat16()
    angles = 50 * torch.randn(angle_batch or batch, tokens, d // 2, generator=g)
    emb = torch.cat((angles, angles), -1)
    return x, emb.cos(), emb.sin()


def _heads(t, d):  # (B, T, H·D) → (B, H, T, D), transformers' view
    return t.view(*t.shape[:2], -1, d).transpose(1, 2)


@pytest.mark.parametrize("d, heads, angle_batch", [(64, 3, None), (6, 5, None), (64, 8, 1)])
def test_the_forward_is_transformers_exactly(lib, d, heads, angle_batch):
    x, cos, sin = _case(d=d, heads=heads, angle_batch=angle_batch)
    q = _heads(x, d)
    theirs, _ = apply_rotary_pos_emb(q, q, cos, sin)
    ours = rope.forward(lib, x, cos, sin, d)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(_heads(ours, d), theirs)


def test_a_strided_projection_is_read_in_place(lib):
    """One row of a wider tensor (as the fused q/k/v projection's slices would be): the same result."""
    x, cos, sin = _case(batch=1, heads=4, d=32)
    wide = torch.cat([x, torch.zeros_like(x)], -1)[..., : x.shape[-1]]
    assert not wide.is_contiguous()
    assert torch.equal(rope.forward(lib, wide, cos, sin, 32), rope.forward(lib, x, cos, sin, 32))


def test_the_backward_is_float64_rounded_once(lib):
    x, cos, sin = _case(d=16, heads=4, seed=1)
    g = torch.Generator().manual_seed(2)
    grad = torch.randn(x.shape, generator=g)  # fp32, as the rotated output's gradient arrives
    ours = rope.backward(lib, grad, cos, sin, 16)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    q = _heads(x.double(), 16).requires_grad_(True)
    out, _ = apply_rotary_pos_emb(q, q.detach(), cos.double(), sin.double())
    out.backward(_heads(grad.double(), 16))
    want = q.grad.transpose(1, 2).reshape(x.shape)
    torch.testing.assert_close(ours.double(), want, rtol=BF16_ROUNDING, atol=1e-6)


def test_both_builds_agree(lib):
    other = rope.library(generic=True)
    x, cos, sin = _case(seed=3)
    assert torch.equal(rope.forward(lib, x, cos, sin, 64), rope.forward(other, x, cos, sin, 64))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(rope.backward(lib, grad, cos, sin, 64).float(),
                               rope.backward(other, grad, cos, sin, 64).float(), rtol=BF16_ROUNDING, atol=1e-6)


def test_inputs_it_does_not_take_go_through_pytorch():
    if rope.library() is None:
        pytest.skip("no C compiler")
    x, cos, sin = _case()
    assert rope.usable(x, cos, sin, 64) is not None
    assert rope.usable(x.float(), cos, sin, 64) is None                   # fp32 projections (an fp32 forward)
    assert rope.usable(x, cos.bfloat16(), sin.bfloat16(), 64) is None     # bf16 angles (a bf16 model)
    assert rope.usable(x, cos, sin, 63) is None                           # odd head size
    assert rope.usable(x, cos[:, :5], sin[:, :5], 64) is None             # angles for other tokens
    assert rope.usable(x.transpose(1, 2).transpose(1, 2)[..., ::2], cos[..., :32], sin[..., :32], 32) is None  # strided last dim
