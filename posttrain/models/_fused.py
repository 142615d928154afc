"""Switching a model's modules to a fused forward: the machinery `fused_norm` and `fused_mlp` share.

A module is switched by changing its class to a cached subclass of its own whose `forward` is the fused one
(the class's own kept as `_unfused_forward`). A subclass, not an instance attribute: `transformers`
re-kernelizes its hub-decorated modules on every `train()`/`eval()` and drops any forward set on an instance.
Each class is probed once (`reproduces`: the fused forward computes that class's own exactly) before any of
its modules is switched."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from posttrain.native import widen


@functools.cache
def fused_class(cls: type[nn.Module], forward: Callable, marker: str) -> type[nn.Module]:
    return type(cls.__name__, (cls,), {"forward": forward, "_unfused_forward": cls.forward, marker: True,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def install(model: nn.Module, *, marker: str, forward: Callable, candidate: Callable[[nn.Module], bool],
            reproduces: Callable[[nn.Module], bool]) -> int:
    """Switch every module of `model` that is a `candidate` and whose class `reproduces` passes. Idempotent;
    returns how many modules were switched."""
    verdict: dict[type, bool] = {}
    switched = 0
    for module in model.modules():
        if getattr(module, marker, False) or not candidate(module):
            continue
        cls = type(module)
        if cls not in verdict:
            verdict[cls] = reproduces(module)
        if verdict[cls]:
            module.__class__ = fused_class(cls, forward, marker)
            switched += 1
    return switched


def weight_grad(a: Tensor, b: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """aᵀ·b over every leading dim flattened: (…, M), (…, N) → (M, N) — a linear's weight gradient, in `dtype` (the
    parameter's; None: the inputs'). A bf16 product for an fp32 parameter is widened by `native.widen` (exact:
    `Tensor.to`'s bits, written in one streamed pass)."""
    grad = a.reshape(-1, a.shape[-1]).t().mm(b.reshape(-1, b.shape[-1]))
    return grad if dtype is None or dtype == grad.dtype else widen.to(grad, dtype)
