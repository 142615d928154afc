"""A LoRA-adapted linear layer of the training forward under autocast, as one autograd node (PEFT's `lora.Linear`).

LoRA (models/lora.py) computes h = W₀x + s·B·A·x, s = α/r. PEFT's forward runs it as separate ops: the base
layer (autocast casts x and W₀ to bf16), x cast to the adapter's dtype (fp32: a copy of every input), A·x under
autocast (x cast back to bf16: a second copy), B·(A·x), the product scaled by s (a pass over the output's
width), then added to the base's output (another), each of them again in the backward. At SmolLM2-135M's GRPO
update with every linear adapted that is ~200 such nodes a forward, and those passes and casts were a fifth of
the update (docs/performance.md, "LoRA layers as one node").

`_LoraLinear` computes x·W₀ᵀ (+ bias) and adds s·(x·Aᵀ)·Bᵀ into it inside one GEMM (`addmm_` accumulating into
the base's output): the input cast once (nothing for a bf16 input), the rank-r products in bf16, no scaled
copy and no separate add. The backward forms the input's gradient as grad·W₀ + (s·grad·B)·A, again one GEMM
accumulating into the other, and the adapters' gradients from the r-wide products, cast back to the
adapters' dtype as autocast's cast node does. It keeps the input (bf16) and x·Aᵀ (r wide) for the backward.

Rounding: the adapter's product joins the base's in fp32 inside the GEMM and is rounded once, where PEFT rounds
B·A·x, its scaling and the sum each to bf16. So the outputs and gradients agree with PEFT's to bf16 round-off,
not bit for bit (tests/test_models_fused_lora.py). In fp32 (no autocast) PEFT's own forward runs.

`install(model)` switches every PEFT `lora.Linear` of `model` to a subclass (`_fused.fused_class`, as the fused
norm and MLP do). Its forward takes the node for a vanilla adapter under autocast — one active adapter, not
merged, no dropout (`lora.dropout` 0, the default), no DoRA or other variant, a plain `nn.Linear` base and
adapters, no extra arguments — and PEFT's forward otherwise (fp32, dropout, adapters disabled, a merged layer).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posttrain.models import _fused, weight_copies

_MARKER = "_fused_lora"


class _LoraLinear(torch.autograd.Function):
    """y = x·W₀ᵀ + bias + s·(x·Aᵀ)·Bᵀ, every product in `dtype`. Saves x (cast), x·Aᵀ and the cast weights."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, scaling: float,
                dtype: torch.dtype) -> Tensor:
        xc, ac, bc = (t.to(dtype) for t in (x, a, b))
        wc = weight_copies.cast(weight, dtype)  # the frozen base: its cast kept from the first forward
        flat = xc.reshape(-1, xc.shape[-1])
        y = torch.nn.functional.linear(flat, wc, None if bias is None else bias.to(dtype))
        h = flat.mm(ac.t())                                  # (N, r)
        y.addmm_(h, bc.t(), alpha=scaling)                  # the adapter's product added inside the GEMM
        ctx.save_for_backward(flat, h, wc, ac, bc)
        ctx.meta = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype, a.dtype, b.dtype, scaling)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        flat, h, wc, ac, bc = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, bias_dtype, a_dtype, b_dtype, scaling = ctx.meta
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        g = grad.reshape(-1, grad.shape[-1]).to(flat.dtype)  # (N, out)
        gh = g.mm(bc).mul_(scaling)                          # (N, r): the gradient at x·Aᵀ
        grad_x = grad_w = grad_bias = None
        if need_x:
            grad_x = g.mm(wc).addmm_(gh, ac).reshape(x_shape).to(x_dtype)
        if need_w:  # a base weight that trains beside its adapter (not LoRA's use; kept correct)
            grad_w = g.t().mm(flat).to(w_dtype)
        if need_bias:
            grad_bias = g.sum(0).to(bias_dtype)
        grad_a = gh.t().mm(flat).to(a_dtype) if need_a else None                 # (r, in)
        grad_b = g.t().mm(h).mul_(scaling).to(b_dtype) if need_b else None       # (out, r)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, None


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, scaling: float,
                dtype: torch.dtype | None = None) -> Tensor:
    """The fused adapted linear as a function. x (…, in); weight (out, in); a (r, in); b (out, r); dtype None: x's."""
    return _LoraLinear.apply(x, weight, bias, a, b, scaling, dtype or x.dtype)


def _plain(module: nn.Module) -> bool:
    return type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)


def _vanilla(self: nn.Module) -> str | None:
    """The one active adapter's name where the node computes this layer's forward, else None."""
    if self.disable_adapters or self.merged or len(self.active_adapters) != 1:
        return None
    name = self.active_adapters[0]
    if name not in self.lora_A or name in getattr(self, "lora_variant", {}) or getattr(self, "use_dora", {}).get(name):
        return None
    a, b, dropout = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
    if not (_plain(a) and _plain(b) and a.bias is None and b.bias is None and _plain(self.base_layer)):
        return None
    if not (isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout) and (dropout.p == 0 or not self.training))):
        return None
    return name


def _forward(self: nn.Module, x: Tensor, *args, **kwargs) -> Tensor:
    device = x.device.type
    name = None if args or kwargs or not torch.is_autocast_enabled(device) else _vanilla(self)
    if name is None:
        return self._unfused_forward(x, *args, **kwargs)
    base = self.base_layer
    with torch.autocast(device, enabled=False):
        return lora_linear(x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight,
                           float(self.scaling[name]), torch.get_autocast_dtype(device))


def _candidate(module: nn.Module) -> bool:
    from peft.tuners.lora import Linear

    return isinstance(module, Linear)


def install(model: nn.Module) -> int:
    """Route every PEFT LoRA linear of `model` through `_LoraLinear` where it applies (PEFT's forward otherwise).
    Idempotent. Returns how many modules were switched."""
    return _fused.install(model, marker=_MARKER, forward=_forward, candidate=_candidate, reproduces=lambda m: True)


def is_fused(module: nn.Module) -> bool:
    return getattr(module, _MARKER, False)
