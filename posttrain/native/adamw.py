"""AdamW's step over fp32 parameters in one pass (kernels/adamw.c): PyTorch's fused CPU AdamW, bit for bit, with
the gradient's clip factor folded in and the parameter's bf16 copy written as it is updated.

`stages/_adamw.AdamW` calls it for every fp32, contiguous CPU parameter where the library is there; PyTorch's
own `torch.optim.AdamW` step (fused) is the reference and the fallback (tests/test_native_adamw.py).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from posttrain import native

_I, _P, _N, _D, _F = ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_double, ctypes.c_float
SIGNATURES: native.Signatures = {  # name: (result, arguments), as in kernels/adamw.c
    "posttrain_adamw_step": (_I, (_N, _P, _P, _P, _P, _P, _D, _D, _D, _D, _D, _D, _D, _F, _I)),
    "posttrain_adamw_vector_path": (_I, ()),
}
LIBRARY = native.Library("adamw", SIGNATURES, "AdamW")


def library(generic: bool = False) -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot be built (warned once) or is turned off."""
    return LIBRARY.get(generic)


def takes(param: Tensor, grad: Tensor | None, *states: Tensor) -> bool:
    """Whether the kernel takes this parameter: fp32, contiguous, on a CPU, a plain tensor (not sharded), its
    gradient and moments alike."""
    tensors = (param, grad, *states)
    return all(t is not None and type(t) in (Tensor, torch.nn.Parameter) and t.dtype == torch.float32
               and t.device.type == "cpu" and t.is_contiguous() and t.shape == param.shape for t in tensors)


def step(lib: ctypes.CDLL, param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, copy: Tensor | None, *,
         lr: float, betas: tuple[float, float], eps: float, weight_decay: float, step: float, coef: float = 1.0) -> None:
    """One AdamW step of `param` in place (and its moments), `grad` multiplied by `coef` first; `copy` (bf16, of
    param's shape, or None) gets bf16(param) after the step. `step` counts from 1 (this step's).

    The kernel takes the tensor's whole blocks of 16 elements; the last `numel % 16` (PyTorch's scalar loop, whose
    rounding differs from its vector loop's) go through PyTorch's own fused kernel, so every element is PyTorch's."""
    beta1, beta2 = betas
    n = param.numel()
    body = n - n % 16
    if body:
        code = lib.posttrain_adamw_step(body, param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                        copy.data_ptr() if copy is not None else None, lr, beta1, beta2, eps,
                                        weight_decay, 1 - beta1 ** step, 1 - beta2 ** step, coef, torch.get_num_threads())
        if code != 0:
            raise RuntimeError(f"posttrain: the C AdamW step failed (code {code}); "
                               f"set {native.ENV_DISABLE}=0 to use PyTorch's")
    if body < n:
        tail = [t.view(-1)[body:] for t in (param, grad, exp_avg, exp_avg_sq)]
        g = tail[1] * coef if coef != 1.0 else tail[1].clone()  # PyTorch's kernel may write the gradient it reads
        torch._fused_adamw_([tail[0]], [g], [tail[2]], [tail[3]], [], [torch.tensor(float(step))], lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        if copy is not None:
            copy.view(-1)[body:] = tail[0]
