"""Rotary position embedding in one pass each way (kernels/rope.c): bf16 projections, fp32 angles.

`models/fused_attention.py` (`_Rotary`) calls it where a query or key projection is bf16 on a CPU and its cos and
sin are fp32 (the Llama family under bf16 autocast over fp32 weights) and the library is there; the ops of
`transformers`' `apply_rotary_pos_emb` are the reference and the fallback. The forward is bit-identical to them.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from posttrain import native

_I, _P, _N = ctypes.c_int, ctypes.c_void_p, ctypes.c_long
SIGNATURES: native.Signatures = {  # name: (result, arguments), as in kernels/rope.c
    "posttrain_rope_forward": (_I, (_N, _I, _I, _P, _N, _P, _P, _P, _I)),
    "posttrain_rope_backward": (_I, (_N, _I, _I, _P, _P, _P, _P, _I)),
}
LIBRARY = native.Library("rope", SIGNATURES, "rotary embedding")


def library(generic: bool = False) -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot be built (warned once) or is turned off."""
    return LIBRARY.get(generic)


def usable(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> ctypes.CDLL | None:
    """The library, where it takes these: x (B, T, H·D) bf16 with unit stride in its last dim, cos and sin
    (B or 1, T, D) fp32, all on a CPU, D = head_dim even."""
    if not (x.dtype == torch.bfloat16 and cos.dtype == sin.dtype == torch.float32
            and x.device.type == cos.device.type == sin.device.type == "cpu" and x.dim() == 3 and x.stride(-1) == 1
            and head_dim > 0 and head_dim % 2 == 0 and x.shape[-1] % head_dim == 0
            and cos.shape == sin.shape and cos.dim() == 3 and cos.shape[1:] == (x.shape[1], head_dim)
            and cos.shape[0] in (1, x.shape[0])):
        return None
    return library()


def _angles(t: Tensor, rows: int, batch: int) -> Tensor:
    """(B or 1, T, D) → (B·T, D) contiguous (a batch of 1 broadcast over B)."""
    return t.expand(batch, *t.shape[1:]).reshape(rows, t.shape[-1]).contiguous()


def forward(lib: ctypes.CDLL, x: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> Tensor:
    """x (B, T, H·D) bf16 rotated: (B, T, H·D) fp32, contiguous, exactly `transformers`' q·cos + rotate_half(q)·sin."""
    batch, tokens, width = x.shape
    rows = batch * tokens
    x2 = x if x.is_contiguous() or batch == 1 else x.contiguous()
    stride = x2.stride(1)
    cos2, sin2 = _angles(cos, rows, batch), _angles(sin, rows, batch)
    out = torch.empty(batch, tokens, width, dtype=torch.float32)
    code = lib.posttrain_rope_forward(rows, width // head_dim, head_dim, x2.data_ptr(), stride, cos2.data_ptr(),
                                      sin2.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"posttrain: the C rotary embedding failed (code {code}); "
                           f"set {native.ENV_DISABLE}=0 to use the PyTorch ops")
    return out


def backward(lib: ctypes.CDLL, grad: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> Tensor:
    """grad (B, T, H·D) of the rotated output (any dtype, any strides) → the input's gradient, bf16 (B, T, H·D)."""
    batch, tokens, width = grad.shape
    rows = batch * tokens
    grad = grad.to(torch.float32).contiguous()
    cos2, sin2 = _angles(cos, rows, batch), _angles(sin, rows, batch)
    out = torch.empty(batch, tokens, width, dtype=torch.bfloat16)
    code = lib.posttrain_rope_backward(rows, width // head_dim, head_dim, grad.data_ptr(), cos2.data_ptr(),
                                       sin2.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"posttrain: the C rotary embedding's backward failed (code {code}); "
                           f"set {native.ENV_DISABLE}=0 to use the PyTorch ops")
    return out
