"""bf16 copies of trainable fp32 weights, written by the optimizer as it updates them and read by the training
forward under autocast where it would cast each weight again.

Under bf16 autocast over fp32 weights every training forward casts every linear weight to bf16 — a read of 4 and
a write of 2 bytes a parameter, from memory, each forward — and the copy it makes equals the one before as long
as the weight has not changed. The optimizer is what changes it: `native/adamw.py`'s step writes bf16(p) in the
same pass that updates p (2 bytes a parameter where the cast moved 6), and `store` keeps it beside the weight.
The fused MLP (`fused_mlp._GatedMLP`) and the fused attention's projections (`linear`) then take the copy
instead of casting: bf16(p) either way, so the forward is bit-identical.

A copy is used only while it is the weight's: it is kept with the weight's version counter and storage address
at the time it was written, and any in-place change through PyTorch (`copy_`, `load_state_dict`, an optimizer
other than ours) moves the version, a `.data` swap the address — the forward then casts as before. The kernel
writes the weight through its pointer, as PyTorch's fused optimizers do, so its own step moves neither.

`want(weight)` marks a weight whose copy a fused forward reads (`fused_mlp.install`, `fused_attention.install`);
the optimizer writes copies of the marked weights only. A frozen weight (`requires_grad` off: LoRA's base, the
layers a LoRA run leaves alone) has no optimizer to write its copy: the first forward's cast is kept as it
(`cast`), valid while the weight stays frozen and unchanged. PEFT's own merge writes the base through `.data`,
which moves no version counter: merges here happen only on a copy of a model (export) or before any forward (a
chain's adapters at load), never on a model being trained.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.models import _fused

_WANT, _COPY = "_posttrain_copy_wanted", "_posttrain_copy"


def want(weight: Tensor) -> None:
    """Mark `weight` as read by a fused training forward (its copy saves that forward's cast)."""
    setattr(weight, _WANT, True)


def wanted(weight: Tensor) -> bool:
    return getattr(weight, _WANT, False)


def store(weight: Tensor, copy: Tensor, *, frozen: bool = False) -> None:
    """Keep `copy` (what `weight` is now, in another dtype) as its copy, until the weight changes — or, `frozen`
    (kept by a forward's cast, not written by the optimizer), until it is set to train."""
    setattr(weight, _COPY, (copy, weight._version, weight.data_ptr(), frozen))


def drop(weight: Tensor) -> None:
    """Forget `weight`'s copy (its writer is changing the weight without writing the copy)."""
    if hasattr(weight, _COPY):
        delattr(weight, _COPY)


def held(weight: Tensor) -> Tensor | None:
    """The copy kept for `weight` (current or not), for the optimizer to write into again; None if none."""
    entry = getattr(weight, _COPY, None)
    return entry[0] if entry is not None else None


def fresh(weight: Tensor, dtype: torch.dtype) -> Tensor | None:
    """`weight`'s copy in `dtype` if one is kept and the weight has not changed since it was written; else None."""
    entry = getattr(weight, _COPY, None)
    if entry is None:
        return None
    copy, version, address, frozen = entry
    if (copy.dtype != dtype or weight._version != version or weight.data_ptr() != address
            or (frozen and weight.requires_grad)):
        return None
    return copy


def cast(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """`weight.to(dtype)` (detached), from its copy where a current one is kept; a frozen weight's cast is kept as its
    copy (LoRA's base, the layers a LoRA run does not adapt: nothing but a load changes them)."""
    copy = fresh(weight, dtype)
    if copy is not None:
        return copy
    copy = weight.detach().to(dtype)
    if not weight.requires_grad and dtype != weight.dtype:
        store(weight, copy, frozen=True)
    return copy


class _Linear(torch.autograd.Function):
    """y = x·Wᵀ in `weight16`'s dtype (the weight's copy, or its cast), the weight's gradient cast back to the
    weight's dtype, as autocast's cast node does: the same casts and matmuls as autocast's own linear, bit for bit
    (tests/test_models_weight_copies.py). One node whether the copy or a cast is read, so a run resumed without
    copies continues as it would have with them."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, weight16: Tensor) -> Tensor:
        xc = x.to(weight16.dtype)
        ctx.save_for_backward(xc, weight16)
        ctx.dtypes = (x.dtype, weight.dtype)
        return F.linear(xc, weight16)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        xc, weight16 = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        grad = grad.to(weight16.dtype)
        grad_x = grad.matmul(weight16).to(x_dtype) if ctx.needs_input_grad[0] else None
        grad_w = _fused.weight_grad(grad, xc, w_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def linear(module: nn.Module, x: Tensor) -> Tensor:
    """`module(x)`; where `module` is a plain bias-free `nn.Linear` without hooks, under autocast with autograd on, as
    one node that reads the weight's current copy in autocast's dtype, or casts it where there is none."""
    if (type(module) is nn.Linear and module.bias is None and not (module._forward_hooks or module._forward_pre_hooks)
            and torch.is_grad_enabled() and torch.is_autocast_enabled(x.device.type)):
        device = x.device.type
        weight16 = cast(module.weight, torch.get_autocast_dtype(device))
        with torch.autocast(device, enabled=False):
            return _Linear.apply(x, module.weight, weight16)
    return module(x)
