"""Per-token log-probs (memory-efficient vs naive), entropy, sequence log-probs."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from posttrain.losses import (
    entropy_from_logits,
    sequence_logprob_mean,
    sequence_logprob_sum,
    token_logprobs,
    token_logprobs_naive,
)

LN2, LN3 = math.log(2), math.log(3)


def _logits(dtype: torch.dtype, *, vocab: int = 1000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(3, 37, vocab, generator=g) * 3).to(dtype)  # (B, T, V), logit scale of a real LM
    y = torch.randint(0, vocab, (3, 37), generator=g)  # (B, T)
    return z, y


def test_token_logprobs_by_hand() -> None:
    z = torch.tensor([[0.0, LN2, LN3]], dtype=torch.float64)  # softmax = [1, 2, 3] / 6
    y = torch.tensor([2])
    # log π(2) = ln(3/6) = −0.693147
    assert token_logprobs(z, y).item() == pytest.approx(-0.693147, abs=1e-6)
    # log π(0) = ln(1/6) = −1.791759
    assert token_logprobs(z, torch.tensor([0])).item() == pytest.approx(-1.791759, abs=1e-6)
    # shifting all logits by 100 changes nothing: ln(2/6) = −1.098612
    assert token_logprobs(z + 100, torch.tensor([1])).item() == pytest.approx(-1.098612, abs=1e-6)


@pytest.mark.parametrize(
    ("dtype", "atol", "rtol"),
    [
        (torch.float64, 1e-12, 0.0),  # same math, fp64 rounding only
        (torch.float32, 2e-5, 0.0),  # |log π| ≤ ~25 here; fp32 ulp at 16 is 2e-6, logsumexp sums 1000 terms
        (torch.bfloat16, 1e-2, 1e-2),  # the naive path rounds to bf16 (ulp 0.0625 at 16): measured ≤ 0.5% off
    ],
)
def test_efficient_path_equals_naive(dtype: torch.dtype, atol: float, rtol: float) -> None:
    z, y = _logits(dtype)
    fast = token_logprobs(z, y, chunk_size=16)  # 16 does not divide 37: ragged last tile
    naive = token_logprobs_naive(z, y)
    assert fast.shape == naive.shape == (3, 37)
    torch.testing.assert_close(fast.to(torch.float64), naive.to(torch.float64), atol=atol, rtol=rtol)


def test_bf16_efficient_path_is_fp32_accurate() -> None:
    z, y = _logits(torch.bfloat16)
    truth = token_logprobs_naive(z.to(torch.float64), y)  # exact log-probs of the same bf16 logits
    fast = token_logprobs(z, y)
    naive = token_logprobs_naive(z, y)
    assert fast.dtype == torch.float32  # departure 2: computed and returned in fp32
    fast_err = (fast.double() - truth).abs().max().item()
    naive_err = (naive.double() - truth).abs().max().item()
    assert fast_err < 1e-4  # fp32 accuracy (measured ~1e-6)
    assert naive_err > 100 * fast_err  # bf16 output rounding: ~0.05 at |log π| ≈ 16


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_efficient_gradient_equals_naive(dtype: torch.dtype) -> None:
    z, y = _logits(dtype, vocab=50)
    w = torch.randn(3, 37, dtype=dtype, generator=torch.Generator().manual_seed(1))  # upstream gradient
    z1 = z.clone().requires_grad_()
    z2 = z.clone().requires_grad_()
    (token_logprobs(z1, y, chunk_size=7) * w).sum().backward()
    (token_logprobs_naive(z2, y) * w).sum().backward()
    torch.testing.assert_close(z1.grad, z2.grad, atol=1e-12 if dtype == torch.float64 else 1e-6, rtol=0)


def test_sliced_causal_logits_and_other_ranks() -> None:
    z, y = _logits(torch.float64, vocab=20)
    # causal-LM alignment: logits[:, :-1] score input_ids[:, 1:] (a non-contiguous view)
    torch.testing.assert_close(token_logprobs(z[:, :-1], y[:, 1:], chunk_size=5),
                               token_logprobs_naive(z[:, :-1], y[:, 1:]), atol=1e-12, rtol=0)
    # (N, V) and (V,) inputs
    torch.testing.assert_close(token_logprobs(z[0], y[0]), token_logprobs_naive(z[0], y[0]), atol=1e-12, rtol=0)
    torch.testing.assert_close(token_logprobs(z[0, 0], y[0, 0]), token_logprobs_naive(z[0, 0], y[0, 0]))
    # rows longer than a chunk are tiled within the row (T=37 > chunk 8)
    torch.testing.assert_close(token_logprobs(z, y, chunk_size=8), token_logprobs_naive(z, y), atol=1e-12, rtol=0)


def test_autograd_saves_no_vocab_sized_tensor() -> None:
    z, y = _logits(torch.float32, vocab=500)
    z.requires_grad_()
    logits_bytes = z.numel() * z.element_size()

    def saved_bytes(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            if t.data_ptr() != z.data_ptr():  # the caller's logits are held anyway
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(z, y).sum()
        return total

    # efficient: tokens (int64) + logsumexp (fp32) = 111·8 + 111·4 = 1332 bytes
    assert saved_bytes(lambda a, b: token_logprobs(a, b, chunk_size=16)) == 3 * 37 * (8 + 4)
    # naive: the (3, 37, 500) fp32 log-softmax = 222,000 bytes, the size of the logits
    assert saved_bytes(token_logprobs_naive) >= logits_bytes


def test_bad_tokens_and_shapes_are_named() -> None:
    z = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match=r"token ids span \[-100, 4\], expected \[0, 5\)"):
        token_logprobs(z, torch.tensor([[0, 4, -100], [1, 1, 1]]))
    with pytest.raises(ValueError, match=r"logits have shape \(2, 3, 5\) and tokens \(2, 2\)"):
        token_logprobs(z, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens must be int64 or int32"):
        token_logprobs(z, torch.zeros(2, 3))


def test_entropy_by_hand() -> None:
    z = torch.tensor([[0.0, LN2, LN3], [5.0, 5.0, 5.0]], dtype=torch.float64)
    # p = [1,2,3]/6: H = (1/6)ln6 + (2/6)ln3 + (3/6)ln2 = 0.298627 + 0.366204 + 0.346574 = 1.011404
    # uniform over 3: H = ln 3 = 1.098612
    torch.testing.assert_close(entropy_from_logits(z), torch.tensor([1.011404, 1.098612], dtype=torch.float64),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
def test_entropy_equals_reference(dtype: torch.dtype, atol: float) -> None:
    z, _ = _logits(dtype, vocab=300)
    ref_logp = torch.log_softmax(z.to(torch.float64), dim=-1)
    reference = -(ref_logp.exp() * ref_logp).sum(-1)  # −Σ p log p in fp64, of the same (rounded) logits
    # bf16 logits are computed in fp32 (departure 2), hence fp32 accuracy for them too
    torch.testing.assert_close(entropy_from_logits(z, chunk_size=10).double(), reference, atol=atol, rtol=0)


def test_sequence_logprobs_by_hand() -> None:
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # row 0: −1 − 2 = −3, mean −3/2 = −1.5; row 1: −0.5 − 0.5 = −1 (the 9.0 in padding is ignored), mean −0.5
    torch.testing.assert_close(sequence_logprob_sum(logps, mask), torch.tensor([-3.0, -1.0]))
    torch.testing.assert_close(sequence_logprob_mean(logps, mask.bool()), torch.tensor([-1.5, -0.5]))


def test_sequence_logprob_mean_rejects_empty_rows() -> None:
    with pytest.raises(ValueError, match=r"rows \[1\] have no tokens in mask"):
        sequence_logprob_mean(torch.zeros(2, 3), torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\), expected \(2, 3\)"):
        sequence_logprob_sum(torch.zeros(2, 3), torch.ones(2, 2))
