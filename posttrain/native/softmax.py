"""The training attention's masked softmax and its backward in one pass each (kernels/softmax.c), bf16.

`models/prefix_attention.py` (`_Softmax`) calls these where the scores are bf16 on a CPU and the library
is there; its PyTorch ops are the reference and the fallback. Each row's mask is a prefix of its keys,
given as one count per (product, query): `limit` (M, L) int32 for scores of shape (M, H, L, S).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from posttrain import native

_I, _P, _N, _F = ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_float
SIGNATURES: native.Signatures = {  # name: (result, arguments), as in kernels/softmax.c
    "posttrain_masked_softmax_bf16": (_I, (_N, _I, _I, _I, _P, _P, _F, _P, _I)),
    "posttrain_masked_softmax_backward_bf16": (_I, (_N, _I, _I, _I, _P, _P, _P, _F, _P, _I)),
    "posttrain_softmax_vector_path": (_I, ()),
    "posttrain_softmax_max_keys": (_I, ()),
}
LIBRARY = native.Library("softmax", SIGNATURES, "softmax")


def library(generic: bool = False) -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot be built (warned once) or is turned off."""
    return LIBRARY.get(generic)


def usable(scores: Tensor, limit: Tensor | None) -> ctypes.CDLL | None:
    """The library, where it takes these scores: bf16, contiguous, on a CPU, 4-D with (M, L) limits and keys
    within the kernel's bound. Without AVX-512 its plain-C loops run, which the compiler vectorises
    (`omp simd`): on an AVX2 host 3× faster than the PyTorch ops forward, even backward (docs/performance.md)."""
    if (limit is None or scores.dtype != torch.bfloat16 or scores.device.type != "cpu" or scores.dim() != 4
            or not scores.is_contiguous()):
        return None
    lib = library()
    if lib is None or scores.shape[-1] > lib.posttrain_softmax_max_keys():
        return None
    return lib


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"posttrain: the C {what} failed (code {code}); "
                           f"set {native.ENV_DISABLE}=0 to use the PyTorch ops")


def forward(lib: ctypes.CDLL, scores: Tensor, limit: Tensor, scale: float) -> Tensor:
    """softmax(scores · scale) over each row's first `limit` keys, 0 past them: (M, H, L, S) bf16."""
    m, h, length, keys = scores.shape
    limit = limit.to(torch.int32).contiguous()
    if limit.shape != (m, length):
        raise ValueError(f"masked softmax: limit of shape {tuple(limit.shape)}, expected {(m, length)}")
    probs = torch.empty_like(scores)
    _check(lib, lib.posttrain_masked_softmax_bf16(m, h, length, keys, scores.data_ptr(), limit.data_ptr(), scale,
                                                  probs.data_ptr(), torch.get_num_threads()), "masked softmax")
    return probs


def backward(lib: ctypes.CDLL, probs: Tensor, grad: Tensor, limit: Tensor, scale: float) -> Tensor:
    """The scores' gradient: scale · probs · (grad − Σ probs · grad) per row, 0 past its limit; bf16."""
    m, h, length, keys = probs.shape
    grad = grad.to(torch.bfloat16).contiguous()
    limit = limit.to(torch.int32).contiguous()
    out = torch.empty_like(probs)
    _check(lib, lib.posttrain_masked_softmax_backward_bf16(m, h, length, keys, probs.data_ptr(), grad.data_ptr(),
                                                           limit.data_ptr(), scale, out.data_ptr(),
                                                           torch.get_num_threads()), "masked softmax backward")
    return out
