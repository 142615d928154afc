"""Token log-probs, entropies and the log-probs' gradient in C (`native/logprobs.py`,
`native/kernels/logprobs.c`) against fp64 references, both builds (vector code where the CPU has it, the
plain-C loops always), and their place in `losses.logprobs`: taken for bf16 and fp32 logits on a CPU, in
place on a strided grid, agreeing with the PyTorch ops (the fallback) to fp32 round-off."""

from __future__ import annotations

import pytest
import torch

from posttrain.losses import entropy_from_logits, row_token_logprobs, token_logprobs
from posttrain.losses import logprobs as losses_logprobs
from posttrain.native import logprobs as kernel

pytestmark = pytest.mark.usefixtures("one_thread")
BF16_ROUNDING = 2 ** -8


KERNEL = kernel  # the `lib` fixture (conftest.py) builds its library both ways


def _case(dtype, vocab, seed=0, rows=3, cols=5):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, cols, vocab, generator=g) * 4).to(dtype)
    y = torch.randint(0, vocab, (rows, cols), generator=g)
    if vocab > 2:
        z[0, 0, : vocab // 2] = float("-inf")  # a row with masked-out logits (as a vocabulary mask gives)
        y[0, 0] = vocab - 1
    return z, y


def _reference(z, y):
    zd = z.double()
    lse = torch.logsumexp(zd, -1)
    p = torch.softmax(zd, -1)
    logp = zd.gather(-1, y[..., None]).squeeze(-1) - lse
    entropy = -(p * torch.where(p > 0, torch.log_softmax(zd, -1), torch.zeros_like(zd))).sum(-1)
    return logp, lse, entropy, p


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 15, 16, 37, 4099])  # one logit, under / at / past a vector, a long row
def test_forward_is_the_fp64_log_softmax_and_entropy(lib, dtype, vocab):
    z, y = _case(dtype, vocab)
    logp, lse, ent = kernel.forward(lib, z, y, entropy=True)
    ref_logp, ref_lse, ref_ent, _ = _reference(z, y)
    assert logp.dtype == lse.dtype == ent.dtype == torch.float32 and logp.shape == (3, 5)
    torch.testing.assert_close(logp.double(), ref_logp, atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=1e-5)
    if vocab == 1:
        assert torch.all(logp == 0) and torch.all(ent == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 15, 37, 4099])
def test_backward_is_grad_times_onehot_minus_softmax_rounded_once(lib, dtype, vocab):
    z, y = _case(dtype, vocab, seed=1)
    g = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    _, lse, _ = kernel.forward(lib, z, y)
    out = kernel.backward(lib, z, y, lse, g)
    _, _, _, p = _reference(z, y)
    ref = g.double()[..., None] * (torch.nn.functional.one_hot(y, vocab).double() - p)
    assert out.dtype == dtype and out.shape == z.shape and out.is_contiguous()
    rounding = BF16_ROUNDING if dtype == torch.bfloat16 else 2e-5  # fp32: the normaliser's sum order
    torch.testing.assert_close(out.double(), ref, atol=5e-6, rtol=rounding)
    if vocab > 2:
        assert torch.all(out[0, 0, : vocab // 2] == 0)  # a -inf logit has no gradient


def test_a_strided_grid_is_read_in_place(lib):
    z, y = _case(torch.bfloat16, 300, seed=3, cols=9)
    view = z[:, :-1]  # a causal LM's logits[:, :-1]: rows at the stride of 9, not contiguous
    assert not view.is_contiguous()
    logp, lse, ent = kernel.forward(lib, view, y[:, 1:], entropy=True)
    clogp, clse, cent = kernel.forward(lib, view.contiguous(), y[:, 1:], entropy=True)
    assert torch.equal(logp, clogp) and torch.equal(lse, clse) and torch.equal(ent, cent)
    g = torch.randn(3, 8)
    assert torch.equal(kernel.backward(lib, view, y[:, 1:], lse, g), kernel.backward(lib, view.contiguous(), y[:, 1:], lse, g))


def test_without_tokens_only_the_normaliser_and_entropy(lib):
    z, _ = _case(torch.float32, 64)
    logp, lse, ent = kernel.forward(lib, z, None, entropy=True)
    assert logp is None
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(ent.double(), _reference(z, torch.zeros(3, 5, dtype=torch.long))[2], atol=2e-5, rtol=1e-5)


def _through_pytorch(monkeypatch):
    monkeypatch.setattr(kernel, "usable", lambda grid: None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_logprobs_takes_the_kernel_and_agrees_with_the_pytorch_ops(monkeypatch, dtype):
    if kernel.library() is None:
        pytest.skip("no C compiler")
    z, y = _case(dtype, 1000, seed=4, cols=12)
    g = torch.randn(3, 11, generator=torch.Generator().manual_seed(5))
    calls = []
    usable = kernel.usable
    monkeypatch.setattr(kernel, "usable", lambda grid: calls.append(grid.shape) or usable(grid))
    za = z.clone().requires_grad_()
    fast = token_logprobs(za[:, :-1], y[:, 1:])
    (fast * g).sum().backward()
    fast_ent = entropy_from_logits(z)
    assert calls, "the kernel was not asked"
    _through_pytorch(monkeypatch)
    zb = z.clone().requires_grad_()
    ref = token_logprobs(zb[:, :-1], y[:, 1:], chunk_size=7)
    (ref * g).sum().backward()
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-6)
    ref_ent = entropy_from_logits(z)
    # row (0, 0) holds -inf logits: PyTorch's Σ p·z is 0 · -inf there (NaN), the kernel's 0
    assert torch.isnan(ref_ent[0, 0]) and torch.isfinite(fast_ent).all()
    fast_ent[0, 0] = ref_ent[0, 0] = 0
    torch.testing.assert_close(fast_ent, ref_ent, atol=2e-5, rtol=1e-5)
    rounding = BF16_ROUNDING if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(za.grad.double(), zb.grad.double(), atol=2e-6, rtol=rounding)


def test_logits_it_does_not_take_go_through_pytorch(monkeypatch):
    assert kernel.usable(torch.zeros(2, 3, 5, dtype=torch.float64)) is None
    assert kernel.usable(torch.zeros(2, 3, 0)) is None
    assert kernel.usable(torch.zeros(2, 5, 3).transpose(1, 2)) is None  # V not contiguous
    # an entropy with a gradient asked for keeps PyTorch's ops (the kernel has no entropy backward)
    seen = []
    monkeypatch.setattr(kernel, "usable", lambda grid: seen.append(1))
    z = torch.randn(2, 3, 7, requires_grad=True)
    entropy_from_logits(z).sum().backward()
    assert not seen and z.grad is not None
    # and fp64 logits keep the exact reference path
    z64 = torch.randn(2, 3, 7, dtype=torch.float64)
    assert losses_logprobs.token_logprobs(z64, torch.zeros(2, 3, dtype=torch.long)).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_token_logprobs_reads_several_tokens_a_row_and_writes_every_rows_gradient(monkeypatch, dtype):
    """Through the kernel where it builds (else the PyTorch ops twice), against the PyTorch ops and the formula."""
    g = torch.Generator().manual_seed(6)
    z = (torch.randn(7, 300, generator=g) * 3).to(dtype)
    # row 0 read by four tokens (two of them the same token), rows 1-4 once each, rows 5-6 by none (a bucket's repeats)
    rows = torch.tensor([0, 0, 0, 0, 1, 2, 3, 4])
    tokens = torch.tensor([5, 9, 5, 299, 0, 17, 17, 3])
    w = torch.randn(8, generator=g)
    za = z.clone().requires_grad_()
    fast = row_token_logprobs(za, rows, tokens)
    (fast * w).sum().backward()
    _through_pytorch(monkeypatch)
    zb, zc = z.clone().requires_grad_(), z.clone().requires_grad_()
    ref = row_token_logprobs(zb, rows, tokens, chunk_size=3)  # the PyTorch ops, chunks of rows that split row groups
    (ref * w).sum().backward()
    (token_logprobs(zc[rows], tokens) * w).sum().backward()   # the gathered rows, as a caller would without it
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-6)
    rounding = BF16_ROUNDING if dtype == torch.bfloat16 else 1e-5  # each element summed in fp32, rounded once
    torch.testing.assert_close(za.grad.double(), zb.grad.double(), atol=2e-6, rtol=rounding)
    assert torch.all(za.grad[5:] == 0) and torch.all(zb.grad[5:] == 0)
    exact = w.double()[:, None] * (torch.nn.functional.one_hot(tokens, 300).double()
                                   - torch.softmax(z.double()[rows], -1))
    exact = torch.zeros(7, 300, dtype=torch.double).index_add(0, rows, exact)
    for grad in (za.grad, zb.grad):
        torch.testing.assert_close(grad.double(), exact, atol=2e-6, rtol=rounding)
    if dtype == torch.float32:  # in bf16 the gathered rows' gradients are each rounded, then summed in bf16
        torch.testing.assert_close(za.grad, zc.grad, atol=2e-6, rtol=1e-5)


def test_row_token_logprobs_names_a_bad_row_or_token():
    z = torch.randn(3, 10)
    with pytest.raises(ValueError, match="rows span"):
        row_token_logprobs(z, torch.tensor([0, 3]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="token ids span"):
        row_token_logprobs(z, torch.tensor([0, 1]), torch.tensor([1, 10]))
    with pytest.raises(ValueError, match="expected"):
        row_token_logprobs(z[None], torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="chunk_size"):
        row_token_logprobs(z, torch.tensor([0]), torch.tensor([1]), chunk_size=0)
