"""Token log-probs and entropies over a vocabulary's logits, and the log-probs' gradient (kernels/logprobs.c).

`losses/logprobs.py` calls these where the logits are bf16 or fp32 on a CPU, their last dimension
contiguous, and the library is there: the forward reads each position's row twice (into L2, no fp32
copy), the backward once, where PyTorch's ops make a dozen passes over an fp32 copy of each chunk. The
PyTorch ops are the reference and the fallback. The grid is `losses.logprobs._as_grid`'s (R, C, V) view:
rows at any stride, so `logits[:, :-1]` is read in place.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from posttrain import native

_I, _P, _N = ctypes.c_int, ctypes.c_void_p, ctypes.c_long
SIGNATURES: native.Signatures = {  # name: (result, arguments), as in kernels/logprobs.c
    "posttrain_token_logprobs": (_I, (_N, _N, _N, _N, _N, _P, _I, _P, _P, _P, _P, _I)),
    "posttrain_token_logprobs_backward": (_I, (_N, _N, _N, _N, _N, _P, _I, _P, _P, _P, _P, _I)),
    "posttrain_row_logprobs_backward": (_I, (_N, _N, _N, _P, _I, _P, _P, _P, _P, _P, _P, _I)),
    "posttrain_logprobs_vector_path": (_I, ()),
}
LIBRARY = native.Library("logprobs", SIGNATURES, "log-prob")


def library(generic: bool = False) -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot be built (warned once) or is turned off."""
    return LIBRARY.get(generic)


def usable(grid: Tensor) -> ctypes.CDLL | None:
    """The library, where it takes this (R, C, V) grid of logits: bf16 or fp32, on a CPU, V contiguous."""
    if grid.dim() != 3 or grid.dtype not in (torch.bfloat16, torch.float32) or grid.device.type != "cpu":
        return None
    if grid.shape[-1] == 0 or (grid.shape[-1] > 1 and grid.stride(-1) != 1):
        return None
    return library()


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"posttrain: the C {what} failed (code {code}); "
                           f"set {native.ENV_DISABLE}=0 to use the PyTorch ops")


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def forward(lib: ctypes.CDLL, grid: Tensor, tokens: Tensor | None, *, entropy: bool = False
            ) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """(logp, lse, entropy) of every row of the (R, C, V) grid, each (R, C) fp32: logp only with `tokens`
    ((R, C) ids), entropy only when asked."""
    rows, cols, vocab = grid.shape
    tokens = None if tokens is None else tokens.to(torch.int64).contiguous()
    logp = None if tokens is None else torch.empty(rows, cols, dtype=torch.float32)
    lse = torch.empty(rows, cols, dtype=torch.float32)
    ent = torch.empty(rows, cols, dtype=torch.float32) if entropy else None
    _check(lib.posttrain_token_logprobs(rows, cols, vocab, grid.stride(0), grid.stride(1), grid.data_ptr(),
                                        int(grid.dtype == torch.bfloat16), _ptr(tokens), _ptr(logp), lse.data_ptr(),
                                        _ptr(ent), torch.get_num_threads()), "token log-probs")
    return logp, lse, ent


def backward(lib: ctypes.CDLL, grid: Tensor, tokens: Tensor, lse: Tensor, grad: Tensor) -> Tensor:
    """grad · (onehot(tokens) − softmax) of every row: (R, C, V), contiguous, in the grid's dtype."""
    rows, cols, vocab = grid.shape
    tokens = tokens.to(torch.int64).contiguous()
    lse, grad = lse.float().contiguous(), grad.float().contiguous()
    out = torch.empty(rows, cols, vocab, dtype=grid.dtype)
    _check(lib.posttrain_token_logprobs_backward(rows, cols, vocab, grid.stride(0), grid.stride(1), grid.data_ptr(),
                                                 int(grid.dtype == torch.bfloat16), tokens.data_ptr(), lse.data_ptr(),
                                                 grad.data_ptr(), out.data_ptr(), torch.get_num_threads()),
           "token log-probs' backward")
    return out


def row_backward(lib: ctypes.CDLL, logits: Tensor, lse: Tensor, rows: Tensor, tokens: Tensor, grad: Tensor) -> Tensor:
    """The gradient of log-probs read several to a row: entry j is `tokens[j]` under row `rows[j]` of the (K, V)
    logits with gradient `grad[j]`. (K, V), contiguous, in the logits' dtype; a row no entry reads gets 0."""
    k, vocab = logits.shape
    rows = rows.to(torch.int64)
    order = torch.argsort(rows, stable=True)
    starts = torch.searchsorted(rows[order], torch.arange(k + 1, dtype=torch.int64))
    tokens = tokens.to(torch.int64).contiguous()
    lse, grad = lse.float().contiguous(), grad.float().contiguous()
    out = torch.empty(k, vocab, dtype=logits.dtype)
    _check(lib.posttrain_row_logprobs_backward(k, vocab, logits.stride(0), logits.data_ptr(),
                                               int(logits.dtype == torch.bfloat16), lse.data_ptr(), starts.data_ptr(),
                                               order.data_ptr(), tokens.data_ptr(), grad.data_ptr(), out.data_ptr(),
                                               torch.get_num_threads()), "row log-probs' backward")
    return out
