"""A bf16 tensor widened to fp32 in one streamed pass (kernels/widen.c): a weight gradient back in its parameter's
dtype.

Under bf16 autocast over fp32 weights a linear's weight gradient comes out of a bf16 matmul and is cast to fp32
for the parameter (`models/_fused.weight_grad`, which the fused MLP and the attention's projections' node,
`weight_copies._Linear`, call). The cast is exact, so the kernel writes `Tensor.to(torch.float32)`'s bits; it writes
them with streaming stores (no read of the destination first), which is what the pass costs: ~10 against ~18 ms
for tiny-30m's linear weights on one core of the AMX Xeon. `Tensor.to` is the reference and the fallback
(tests/test_native_widen.py).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from posttrain import native

_I, _P, _N = ctypes.c_int, ctypes.c_void_p, ctypes.c_long
SIGNATURES: native.Signatures = {  # name: (result, arguments), as in kernels/widen.c
    "posttrain_widen_bf16": (_I, (_N, _P, _P, _I)),
    "posttrain_widen_vector_path": (_I, ()),
}
LIBRARY = native.Library("widen", SIGNATURES, "bf16-to-fp32 widening")
MIN_ELEMENTS = 1 << 16  # below this the call's fixed cost is what a small tensor's cast costs: `Tensor.to`


def library(generic: bool = False) -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot be built (warned once) or is turned off."""
    return LIBRARY.get(generic)


def usable(t: Tensor, dtype: torch.dtype) -> ctypes.CDLL | None:
    """The library, where it widens `t` to `dtype`: bf16 to fp32, contiguous, on a CPU, large enough to matter."""
    if not (t.dtype == torch.bfloat16 and dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            and t.numel() >= MIN_ELEMENTS):
        return None
    return library()


def widen(lib: ctypes.CDLL, t: Tensor) -> Tensor:
    """fp32(t), a new tensor of t's shape: `t.to(torch.float32)` bit for bit. t: bf16, contiguous, on a CPU."""
    out = torch.empty(t.shape, dtype=torch.float32)
    code = lib.posttrain_widen_bf16(t.numel(), t.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"posttrain: the C bf16 widening failed (code {code}); "
                           f"set {native.ENV_DISABLE}=0 to use PyTorch's cast")
    return out


def to(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t.to(dtype)`, through the kernel where it takes the pair (bf16 → fp32 on a CPU)."""
    lib = usable(t, dtype)
    return widen(lib, t) if lib is not None else t.to(dtype)
