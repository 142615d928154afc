"""AdamW whose step runs the C kernel (native/adamw.py): PyTorch's fused CPU AdamW bit for bit, the gradient clip's
factor folded into the same pass, and the bf16 copies of the weights the training forward reads
(models/weight_copies.py) written as the weights are updated.

`build_optimizer` makes one wherever it would make `torch.optim.AdamW(fused=True)`. The state (`step`, `exp_avg`,
`exp_avg_sq`) and its `state_dict` are AdamW's own, so checkpoints and resume do not know the difference; a
parameter the kernel does not take (not fp32, not contiguous, not on a CPU, sharded) sends the whole step to
PyTorch's fused kernel, with the clip factor applied to the gradients first, as `clip_grads_with_norm_` does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.models import weight_copies
from posttrain.native import adamw


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW(fused=True)` whose `step(coef=…)` also multiplies every gradient by `coef` (the clip's
    factor, 1 for none) and writes the marked weights' bf16 copies."""

    def __init__(self, params, **kwargs):
        super().__init__(params, fused=True, **kwargs)

    def kernel_ready(self) -> bool:
        """Whether the next step runs the C kernel: the library is there and takes every parameter with a gradient."""
        return self._kernel_takes_all() and adamw.library() is not None  # no build where no parameter is the kernel's

    def _kernel_takes_all(self) -> bool:
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]:
                return False
            if isinstance(group["lr"], Tensor):
                return False
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.get(p)
                states = (state["exp_avg"], state["exp_avg_sq"]) if state else ()
                if not adamw.takes(p, p.grad, *states):
                    return False
        return True

    @torch.no_grad()
    def step(self, closure=None, *, coef: float = 1.0):
        """One step over every parameter with a gradient, each gradient multiplied by `coef` first."""
        lib = adamw.library() if closure is None and self._kernel_takes_all() else None
        if lib is None:
            for group in self.param_groups:  # PyTorch's step does not write the copies: none may outlive it
                for p in group["params"]:
                    weight_copies.drop(p)
            if coef != 1.0:
                grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
                torch._foreach_mul_(grads, torch.tensor(coef, dtype=torch.float32))
            return super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # as torch.optim.AdamW(fused=True) lays it out
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                copy = None
                if weight_copies.wanted(p):
                    copy = weight_copies.held(p)
                    if copy is None or copy.shape != p.shape or copy.dtype != torch.bfloat16:
                        copy = torch.empty(p.shape, dtype=torch.bfloat16)
                adamw.step(lib, p, p.grad, state["exp_avg"], state["exp_avg_sq"], copy, lr=group["lr"],
                           betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                           step=float(state["step"]), coef=coef)
                if copy is not None:
                    weight_copies.store(p, copy)
        return None
