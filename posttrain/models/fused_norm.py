"""RMSNorm for the training forward under autocast: one autograd node, its output already in the autocast dtype.

Under bf16 autocast over fp32 weights, `transformers`' RMSNorm (Zhang & Sennrich 2019; the Llama family's
`weight * x / sqrt(mean(x²) + eps)`) is six elementwise ops that each keep their operands for the
backward — among them the normalized activation in fp32 — and its fp32 output is cast to bf16 again by
every linear that reads it: three times before q/k/v, twice before gate/up, each cast its own copy kept
for that linear's backward. `install(model)` routes each such norm module through `_RMSNorm` (by
switching it to a subclass of its own class): the same arithmetic in the same order (the forward is bit-identical to `transformers` + the
cast), one output in the autocast dtype that every reader shares, and only the input and one reciprocal
RMS per row kept for the backward, which recomputes the rest. On a CPU that backward is one pass over each
row in C (`native/rmsnorm.py`: at DPO's 256-token pairs 1.1 ms against the PyTorch ops' 17.2 per norm, 21
norms a step), and so are the forward's last three passes — x · rstd, times the weight, the cast — rounded as
those ops round, so bit-identical to them (1.9 against 2.8 ms there with rstd's own ops, which stay PyTorch's:
their reduction order is theirs; `benchmarks/rmsnorm_kernel.py`).
The PyTorch ops below are the kernels' reference and fallback.

Measured (tiny-30m, bf16, 1 thread, before and after alternated, each in its own process): the DPO stage
at 64-token pairs 1.35–1.38 → 1.19–1.20 s a step and 1,449–1,462 → 1,320–1,364 MiB peak; at 1,024-token
pairs 8,366 → 6,375 MiB (two single runs, hours apart); the GRPO update at 32 tokens 0.97 → 0.90 s (docs/performance.md, "The fused
RMSNorm").

What it departs from: the backward's round-off (its gradients agree with `transformers`' to bf16
round-off; in float64 the formula's own autograd gradients to 1e-12, tests/test_models_fused_norm.py). What it leaves alone: a norm whose
forward it does not reproduce exactly in fp32 (Gemma's `1 + weight`, a norm with a bias, anything new) —
`install` checks each norm class against its own forward on a random input and keeps that class's forward
when the two differ; outside autocast, or for an input that is not fp32 (Qwen3's q/k norms run on bf16
projections), every replaced norm calls its own forward.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from posttrain.models import _fused
from posttrain.native import rmsnorm


class _RMSNorm(torch.autograd.Function):
    """y = (x · rstd · w) in `out_dtype`, rstd = 1/√(mean(x²) + eps) over the last dim. Saves x and rstd."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (…, 1)
        ctx.save_for_backward(x, weight, rstd)
        if out_dtype == x.dtype:
            return weight * (x * rstd)
        lib = rmsnorm.usable_forward(x, weight, rstd, out_dtype)
        if lib is not None:  # the scaling and the cast in one pass in C, bit-identical to the ops below
            return rmsnorm.scale(lib, x, weight, rstd)
        return (weight * (x * rstd)).to(out_dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, weight, rstd = ctx.saved_tensors
        lib = rmsnorm.usable(x, weight, rstd, grad)
        if lib is not None:  # one pass over each row in C (native/rmsnorm.py); the ops below are its reference
            grad_x, grad_w = rmsnorm.backward(lib, x, weight, rstd, grad, need_x=ctx.needs_input_grad[0],
                                              need_w=ctx.needs_input_grad[1])
            return grad_x, grad_w, None, None
        grad = grad.to(x.dtype)
        x_hat = x * rstd
        grad_w = (grad * x_hat).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, grad_w, None, None
        g = grad * weight
        # d/dx of x·rstd: rstd · (g − x̂ · mean(g · x̂))
        grad_x = (g - x_hat * (g * x_hat).mean(-1, keepdim=True)).mul_(rstd)
        return grad_x, grad_w, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    """The fused norm as a function (out_dtype None: x's dtype). Shapes: x (…, D), weight (D,)."""
    return _RMSNorm.apply(x, weight, eps, out_dtype or x.dtype)


def _eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, int | float) else None


def _candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, Tensor) and weight.ndim == 1
            and _eps(module) is not None and getattr(module, "bias", None) is None)


def _reproduces(module: nn.Module) -> bool:
    """Whether `_RMSNorm` computes this module's own forward exactly: fp32, a random input and weight."""
    d, device = module.weight.shape[0], module.weight.device
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, d, generator=gen).to(device)
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(device)
    probe = copy.deepcopy(module).float()
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        probe.weight.copy_(w)
        try:
            theirs = probe(x)
        except Exception:  # noqa: BLE001 - a forward we cannot call on its own is one we leave alone
            return False
        ours = rms_norm(x, w, _eps(module))
    return isinstance(theirs, Tensor) and theirs.dtype == ours.dtype and torch.equal(theirs, ours)


def _forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    device = hidden_states.device.type
    if hidden_states.dtype != torch.float32 or not torch.is_autocast_enabled(device):
        return self._unfused_forward(hidden_states)
    with torch.autocast(device, enabled=False):
        return rms_norm(hidden_states, self.weight, _eps(self), torch.get_autocast_dtype(device))


def install(model: nn.Module) -> int:
    """Route every RMSNorm of `model` that `_RMSNorm` reproduces through it (each module's own forward otherwise).
    Idempotent. Returns how many modules were switched."""
    return _fused.install(model, marker="_fused_norm", forward=_forward, candidate=_candidate, reproduces=_reproduces)


def is_fused(module: nn.Module) -> bool:
    return getattr(module, "_fused_norm", False)
