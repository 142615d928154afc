"""The weight gradients' bf16 → fp32 widening in C (`native/widen.py`, `native/kernels/widen.c`): `Tensor.to`'s bits
in both builds (the AVX-512 code with its streamed stores where the CPU has it, the plain-C loop always), at one and
two threads, on unaligned starts, odd lengths and every special value; and its place in `_fused.weight_grad`, which
the fused MLP and the projections' node call: taken for a bf16 product of an fp32 parameter, nowhere else."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import _fused
from posttrain.native import widen

KERNEL = widen  # the `lib` fixture (conftest.py) builds its library both ways


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 15, 17, 1 << 16, (1 << 17) + 7])  # tails around a vector, across thread chunks
def test_every_bit_is_the_casts(lib, n, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # every bf16 bit pattern: ±0, subnormals, ±inf, NaNs with their payloads
        src = torch.arange(n, dtype=torch.int32).remainder(1 << 16).to(torch.int16).view(torch.bfloat16)
        assert torch.equal(_bits(widen.widen(lib, src)), _bits(src.to(torch.float32)))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("offset", [1, 3, 8])
def test_a_destination_off_the_cache_line_is_written_whole(lib, offset):
    """The streamed stores want 64-byte lines: a view into the middle of a buffer starts with plain stores."""
    src = torch.randn(4096 + 33).bfloat16()
    out = torch.full((4096 + 33 + offset,), 7.0)
    code = lib.posttrain_widen_bf16(src.numel(), src.data_ptr(), out[offset:].data_ptr(), 1)
    assert code == 0
    assert torch.equal(out[offset:], src.float()) and torch.equal(out[:offset], torch.full((offset,), 7.0))


def test_weight_grad_widens_a_bf16_product_for_an_fp32_parameter(monkeypatch):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 40, 512, generator=g).bfloat16(), torch.randn(3, 40, 256, generator=g).bfloat16()
    expected = a.reshape(-1, 512).t().mm(b.reshape(-1, 256)).float()
    calls = []
    real = widen.widen
    monkeypatch.setattr(widen, "widen", lambda lib, t: calls.append(t.shape) or real(lib, t))
    got = _fused.weight_grad(a, b, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    if widen.library() is not None:
        assert calls == [(512, 256)]
    calls.clear()
    assert _fused.weight_grad(a, b).dtype == torch.bfloat16            # the inputs' dtype: nothing to widen
    assert _fused.weight_grad(a, b, torch.bfloat16).dtype == torch.bfloat16
    small = _fused.weight_grad(a[..., :8], b[..., :8], torch.float32)   # under MIN_ELEMENTS: PyTorch's cast
    assert torch.equal(small, a[..., :8].reshape(-1, 8).t().mm(b[..., :8].reshape(-1, 8)).float())
    assert calls == []


def test_off_it_is_pytorchs_cast(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_C_KERNELS", "0")
    t = torch.randn(1 << 16).bfloat16()
    assert widen.usable(t, torch.float32) is None
    assert torch.equal(widen.to(t, torch.float32), t.float())
