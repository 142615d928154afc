"""The training attention's masked softmax in C (`native/softmax.py`, `native/kernels/softmax.c`) against
PyTorch's fp32 softmax, both builds (vector code where the CPU has it, the plain-C loops always), and
its place in `prefix_attention._Softmax`: taken for bf16 scores, the same probabilities and gradients as
the PyTorch ops within one bf16 rounding, its per-query key counts the same mask as the bias."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import prefix_attention
from posttrain.models.prefix_attention import Segments
from posttrain.native import softmax as softmax_kernel

pytestmark = pytest.mark.usefixtures("one_thread")
BF16_ROUNDING = 2 ** -8  # one rounding to bf16: relative error at most 2^-9, two of them 2^-8


KERNEL = softmax_kernel  # the `lib` fixture (conftest.py) builds its library both ways


def _case(m=3, h=4, length=7, keys=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(m, h, length, keys, generator=g) * 4).bfloat16()
    limit = torch.randint(1, keys + 1, (m, length), generator=g, dtype=torch.int32)
    limit[0, 0], limit[-1, -1] = 1, keys  # one key only, and all of them
    allowed = torch.arange(keys) < limit[..., None].long()
    return scores, limit, allowed[:, None]  # allowed: (M, 1, L, S)


def test_forward_is_the_fp32_softmax_over_each_rows_prefix_rounded_once(lib):
    scores, limit, allowed = _case()
    probs = softmax_kernel.forward(lib, scores, limit, 0.3)
    ref = torch.softmax((scores.double() * 0.3).masked_fill(~allowed, float("-inf")), dim=-1)
    assert probs.dtype == torch.bfloat16 and probs.shape == scores.shape
    assert torch.all(probs[~allowed.expand_as(probs)] == 0)                  # exactly 0 past the limit
    torch.testing.assert_close(probs.double(), ref, rtol=BF16_ROUNDING, atol=1e-6)
    torch.testing.assert_close(probs.double().sum(-1), torch.ones(probs.shape[:-1], dtype=torch.double),
                               rtol=0, atol=probs.shape[-1] * BF16_ROUNDING)
    assert torch.all(probs[0, :, 0, 0] == 1)                                 # a single key takes it all


def test_backward_is_the_softmax_gradient_of_the_kept_probabilities(lib):
    scores, limit, allowed = _case(seed=1)
    probs = softmax_kernel.forward(lib, scores, limit, 0.3)
    grad = torch.randn(probs.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = softmax_kernel.backward(lib, probs, grad, limit, 0.3)
    p, g = probs.double(), grad.double()
    ref = 0.3 * p * (g - (p * g).sum(-1, keepdim=True))
    assert out.dtype == torch.bfloat16 and torch.all(out[~allowed.expand_as(out)] == 0)
    torch.testing.assert_close(out.double(), ref, rtol=BF16_ROUNDING, atol=1e-5)


def test_large_and_very_negative_scores_stay_finite(lib):
    scores = torch.tensor([[[[3e4, -3e4, 0.0, 1e-3]]]]).bfloat16()
    limit = torch.tensor([[4]], dtype=torch.int32)
    probs = softmax_kernel.forward(lib, scores, limit, 1.0)
    assert torch.equal(probs.float(), torch.tensor([[[[1.0, 0.0, 0.0, 0.0]]]]))


def _plan_segments() -> Segments:
    # two GRPO-like groups with ragged slots and a DPO-like pair: prompts of 5, 3 and 8 columns
    prefixes, slots, at = [], [], 0
    for p, lengths in ((5, (4, 9, 1)), (3, (7, 7)), (8, (6, 2))):
        prefixes.append((at, p))
        at += p
        group = []
        for n in lengths:
            group.append((at, n))
            at += n
        slots.append(tuple(group))
    return Segments(tuple(prefixes), tuple(slots))


def test_the_plans_key_counts_are_its_bias_mask():
    plan = prefix_attention._plan(_plan_segments(), 10**9, 10**9, 0, torch.device("cpu"))
    matmul = [b for b in plan.buckets if not b.sdpa]
    assert matmul and all(b.limit is not None and b.limit.dtype == torch.int32 for b in matmul)
    for b in matmul:
        assert b.limit.shape == (b.m, b.length)
        from_counts = torch.arange(b.keys) < b.limit[..., None].long()          # (M, L, S)
        assert torch.equal(from_counts, b.mask[:, 0, 0] == 0)


@pytest.mark.parametrize("groups", [1, 2])
def test_the_attention_softmax_takes_the_kernel_for_bf16_and_agrees_with_pytorch(monkeypatch, groups):
    if softmax_kernel.library() is None:
        pytest.skip("no C compiler")
    m, hkv, length, keys = 3, 2, 6, 11
    _, limit, allowed = _case(m=m, h=1, length=length, keys=keys, seed=3)
    bias = torch.zeros(m, 1, 1, length, keys).masked_fill_(~allowed[:, :, None], float("-inf"))
    base = torch.randn(m, hkv, groups, length, keys, generator=torch.Generator().manual_seed(4)) * 3
    weight = torch.randn(base.shape, generator=torch.Generator().manual_seed(5))
    calls = []
    forward = softmax_kernel.forward
    monkeypatch.setattr(softmax_kernel, "forward", lambda *a: calls.append(1) or forward(*a))
    runs = []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(softmax_kernel, "usable", lambda scores, limit: None)
        scores = base.bfloat16().requires_grad_()
        probs = prefix_attention._Softmax.apply(scores, bias, limit, 0.25, torch.bfloat16)
        (probs.float() * weight).sum().backward()
        runs.append((probs.detach(), scores.grad))
    assert calls == [1]                                                       # the first run took the kernel
    (p_c, g_c), (p_t, g_t) = runs
    torch.testing.assert_close(p_c.float(), p_t.float(), rtol=2 * BF16_ROUNDING, atol=1e-6)
    torch.testing.assert_close(g_c.float(), g_t.float(), rtol=4 * BF16_ROUNDING, atol=1e-3)


def test_scores_it_does_not_take_go_through_pytorch():
    if softmax_kernel.library() is None:
        pytest.skip("no C compiler")
    scores, limit, _ = _case()
    assert softmax_kernel.usable(scores, limit) is not None
    assert softmax_kernel.usable(scores.float(), limit) is None                     # fp32: the PyTorch ops
    assert softmax_kernel.usable(scores, None) is None                              # no key counts
    assert softmax_kernel.usable(scores.transpose(-1, -2), limit) is None           # not contiguous
    wide = torch.zeros(1, 1, 1, softmax_kernel.library().posttrain_softmax_max_keys() + 1, dtype=torch.bfloat16)
    assert softmax_kernel.usable(wide, limit[:1, :1]) is None                       # past the stack buffer
