"""The fused RMSNorm on fp32 rows in C (kernels/rmsnorm.c): the forward's scaling and cast to bf16, and the
backward, one pass over each row each.

`models/fused_norm.py` (`_RMSNorm`) calls them where the input is fp32 on a CPU (the residual stream under
autocast over fp32 weights) and the library is there; its PyTorch ops are the reference and the fallback
(forward: x · rstd, times the weight, the cast — three passes, bit-identical to the kernel's one; backward:
eight elementwise passes and two reductions).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from posttrain import native

_I, _P, _N = ctypes.c_int, ctypes.c_void_p, ctypes.c_long
SIGNATURES: native.Signatures = {  # name: (result, arguments), as in kernels/rmsnorm.c
    "posttrain_rms_norm_backward": (_I, (_N, _I, _P, _P, _P, _P, _I, _P, _P, _I)),
    "posttrain_rms_norm_scale_bf16": (_I, (_N, _I, _P, _P, _P, _P, _I)),
}
LIBRARY = native.Library("rmsnorm", SIGNATURES, "RMSNorm")


def library(generic: bool = False) -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot be built (warned once) or is turned off."""
    return LIBRARY.get(generic)


def usable(x: Tensor, weight: Tensor, rstd: Tensor, grad: Tensor) -> ctypes.CDLL | None:
    """The library, where it takes these: x, weight, rstd fp32 and grad fp32 or bf16, on a CPU, x and grad of
    one shape (…, D), weight (D,), rstd (…, 1)."""
    if not (x.dtype == weight.dtype == rstd.dtype == torch.float32 and grad.dtype in (torch.float32, torch.bfloat16)
            and x.device.type == weight.device.type == rstd.device.type == grad.device.type == "cpu"
            and x.dim() >= 1 and grad.shape == x.shape and weight.shape == x.shape[-1:]
            and rstd.shape == (*x.shape[:-1], 1)):
        return None
    return library()


def backward(lib: ctypes.CDLL, x: Tensor, weight: Tensor, rstd: Tensor, grad: Tensor, *, need_x: bool = True,
             need_w: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """(The input's gradient, fp32 of x's shape, where `need_x`; the weight's, fp32 (D,), where `need_w`)."""
    x, weight, rstd, grad = (t.contiguous() for t in (x, weight, rstd, grad))
    d = x.shape[-1]
    grad_x = torch.empty_like(x) if need_x else None
    grad_w = torch.empty_like(weight) if need_w else None
    code = lib.posttrain_rms_norm_backward(x.numel() // max(d, 1), d, x.data_ptr(), weight.data_ptr(), rstd.data_ptr(),
                                           grad.data_ptr(), int(grad.dtype == torch.bfloat16),
                                           grad_x.data_ptr() if grad_x is not None else None,
                                           grad_w.data_ptr() if grad_w is not None else None, torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"posttrain: the C RMSNorm backward failed (code {code}); "
                           f"set {native.ENV_DISABLE}=0 to use the PyTorch ops")
    return grad_x, grad_w


def usable_forward(x: Tensor, weight: Tensor, rstd: Tensor, out_dtype: torch.dtype) -> ctypes.CDLL | None:
    """The library, where the forward's scaling takes these: x (…, D), weight (D,), rstd (…, 1) fp32 on a CPU,
    a bf16 output."""
    if not (out_dtype == torch.bfloat16 and x.dtype == weight.dtype == rstd.dtype == torch.float32
            and x.device.type == weight.device.type == rstd.device.type == "cpu" and x.dim() >= 1
            and weight.shape == x.shape[-1:] and rstd.shape == (*x.shape[:-1], 1)):
        return None
    return library()


def scale(lib: ctypes.CDLL, x: Tensor, weight: Tensor, rstd: Tensor) -> Tensor:
    """bf16(weight · (x · rstd)) of x's shape: exactly the PyTorch ops' result, in one pass."""
    x, weight, rstd = (t.contiguous() for t in (x, weight, rstd))
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    code = lib.posttrain_rms_norm_scale_bf16(x.numel() // max(d, 1), d, x.data_ptr(), weight.data_ptr(),
                                             rstd.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"posttrain: the C RMSNorm forward failed (code {code}); "
                           f"set {native.ENV_DISABLE}=0 to use the PyTorch ops")
    return out
