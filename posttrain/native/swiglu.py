"""The gated MLP's h = silu(gate) ⊙ up in one pass each way (kernels/swiglu.c), bf16.

`models/fused_mlp.py` calls it in `_GatedMLP` and `_SiluMul` where gate and up are bf16 on a CPU and the
library is there. The forward (`product`) is PyTorch's two ops, `F.silu(gate) * up`, in one pass with
one output instead of two, rounded as they round (bit-identical but below a gate of −87.3, where e^g leaves
fp32's normal range and the kernel's SiLU is 0, PyTorch's under 1e-36: tests/test_native_swiglu.py); the
backward replaces five ops (`F.silu`, three products, `aten.silu_backward`: five passes, five
intermediate-width temporaries). The PyTorch ops are the reference and the fallback.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from posttrain import native

_I, _P, _N = ctypes.c_int, ctypes.c_void_p, ctypes.c_long
SIGNATURES: native.Signatures = {  # name: (result, arguments), as in kernels/swiglu.c
    "posttrain_swiglu_forward_bf16": (_I, (_N, _P, _P, _P, _I)),
    "posttrain_swiglu_backward_bf16": (_I, (_N, _P, _P, _P, _P, _P, _P, _I)),
    "posttrain_swiglu_vector_path": (_I, ()),
}
LIBRARY = native.Library("swiglu", SIGNATURES, "gated-MLP")


def library(generic: bool = False) -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot be built (warned once) or is turned off."""
    return LIBRARY.get(generic)


def usable(gate: Tensor, up: Tensor) -> ctypes.CDLL | None:
    """The library, where it takes these tensors: bf16, contiguous, on a CPU, of one shape."""
    if not (gate.dtype == up.dtype == torch.bfloat16 and gate.device.type == up.device.type == "cpu"
            and gate.shape == up.shape and gate.is_contiguous() and up.is_contiguous()):
        return None
    return library()


def product(lib: ctypes.CDLL, gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) ⊙ up, bf16 of gate's shape: `F.silu(gate) * up` bit for bit (gates above −87.3), in one pass."""
    out = torch.empty_like(gate)
    code = lib.posttrain_swiglu_forward_bf16(gate.numel(), gate.data_ptr(), up.data_ptr(), out.data_ptr(),
                                             torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"posttrain: the C gated-MLP forward failed (code {code}); "
                           f"set {native.ENV_DISABLE}=0 to use the PyTorch ops")
    return out


def backward(lib: ctypes.CDLL, gate: Tensor, up: Tensor, grad: Tensor, *, product: bool = True
             ) -> tuple[Tensor | None, Tensor, Tensor]:
    """(silu(gate) ⊙ up as the forward rounded it, or None where `product` is False; the gradient through
    gate; through up), for `grad` the gradient of h. All bf16, of gate's shape."""
    if grad.shape != gate.shape:
        raise ValueError(f"gated-MLP backward: grad of shape {tuple(grad.shape)}, expected {tuple(gate.shape)}")
    grad = grad.to(torch.bfloat16).contiguous()
    prod = torch.empty_like(gate) if product else None
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(gate)
    code = lib.posttrain_swiglu_backward_bf16(gate.numel(), gate.data_ptr(), up.data_ptr(), grad.data_ptr(),
                                              prod.data_ptr() if prod is not None else None, grad_gate.data_ptr(),
                                              grad_up.data_ptr(), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"posttrain: the C gated-MLP backward failed (code {code}); "
                           f"set {native.ENV_DISABLE}=0 to use the PyTorch ops")
    return prod, grad_gate, grad_up
