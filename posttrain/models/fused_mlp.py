"""The gated MLP of the training forward under autocast, as one autograd node that keeps two of its four activations.

The Llama family's MLP (Shazeer 2020's SwiGLU) is `down(silu(gate(x)) * up(x))`. Run op by op under autograd it
keeps four intermediate-width tensors per token for the backward — `gate(x)` (for the SiLU), `silu(gate(x))`
and `up(x)` (for the product), the product (for `down`) — which at tiny-30m's shapes (hidden 512, intermediate
1,408) are a third to two fifths of what a training step keeps once the norm is fused. `_GatedMLP` keeps
`gate(x)` and `up(x)` and recomputes the other two in the backward. On a CPU in bf16 the elementwise middle
is one pass of a C kernel each way (`native/swiglu.py`): the forward's `silu(gate) * up` (one output instead
of two, rounded as PyTorch's two ops round), and the backward's SiLU and product recomputed with the two
gradients through them (2.2× the five PyTorch ops it replaces, three temporaries instead of five); the
PyTorch ops are their reference and fallback.
`_SiluMul` is the same idea for an MLP whose projections are not plain linears (a LoRA adapter's, a quantized
layer): the SiLU-times-up node alone, keeping `gate(x)` and `up(x)`, one tensor fewer.

The forward computes what `transformers` computes under autocast, rounded the same way, so it is
bit-identical (tests/test_models_fused_mlp.py, a whole model's logits with `torch.equal`) — but for a gate
below −87.3, whose SiLU (under 1e-36 in magnitude) the C kernel returns as 0; the gradients are computed by the
same kernels (`aten.silu_backward`, products and matmuls in the autocast dtype, the weights' gradients cast
back to theirs, as autocast's own cast node does), and agree with autograd's to bf16 round-off.

Measured (`benchmarks/fused_layers.py`, 8 DPO pairs forward + backward on tiny-30m, bf16, the arms switched in
one process): the bytes kept for the backward 1,289 → 1,062 MiB at 256-token pairs and 3,904 → 2,995 at
1,024 (after the fused norm), the time within noise (4.17 → 4.26 s, 28.90 → 29.41; docs/performance.md,
"The fused gated MLP").

`install(model)` switches each MLP class whose own forward `_GatedMLP` reproduces exactly on a probe (fp32,
random input and weights) to a subclass of its own, as `fused_norm` does; a GELU MLP (Gemma), one with biases,
or anything else new keeps its forward. Outside autocast, or with autograd off (a reference or evaluation
forward), the module's own forward runs.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.models import _fused, weight_copies
from posttrain.native import swiglu


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) ⊙ up: one pass of kernels/swiglu.c for bf16 on a CPU (bit-identical), else the PyTorch ops."""
    lib = swiglu.usable(gate, up)
    return swiglu.product(lib, gate, up) if lib is not None else F.silu(gate) * up


def _silu_mul_backward(gate: Tensor, up: Tensor, grad_h: Tensor, *, product: bool
                       ) -> tuple[Tensor | None, Tensor, Tensor]:
    """For h = silu(gate) ⊙ up and grad_h its gradient: (h as the forward computed it, where `product`; the
    gradient through gate; through up). One pass of kernels/swiglu.c for bf16 on a CPU, else the PyTorch ops."""
    lib = swiglu.usable(gate, up)
    if lib is not None and grad_h.shape == gate.shape:
        return swiglu.backward(lib, gate, up, grad_h, product=product)
    act = F.silu(gate)
    return (act * up if product else None), torch.ops.aten.silu_backward(grad_h * up, gate), grad_h * act


class _GatedMLP(torch.autograd.Function):
    """y = down(silu(x·Wgᵀ) ⊙ x·Wuᵀ), every product in `dtype`. Saves x, x·Wgᵀ, x·Wuᵀ and the cast weights."""

    @staticmethod
    def forward(ctx, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, dtype: torch.dtype) -> Tensor:
        xc = x.to(dtype)
        wg, wu, wd = (weight_copies.cast(w, dtype) for w in (w_gate, w_up, w_down))  # the optimizer's copies, if current
        gate, up = F.linear(xc, wg), F.linear(xc, wu)
        y = F.linear(_silu_mul(gate, up), wd)
        ctx.save_for_backward(xc, gate, up, wg, wu, wd)
        ctx.dtypes = (x.dtype, w_gate.dtype, w_up.dtype, w_down.dtype)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        xc, gate, up, wg, wu, wd = ctx.saved_tensors
        x_dtype, g_dtype, u_dtype, d_dtype = ctx.dtypes
        need_x, need_g, need_u, need_d = ctx.needs_input_grad[:4]
        grad = grad.to(xc.dtype)
        if not (need_x or need_g or need_u):
            return None, None, None, _fused.weight_grad(grad, _silu_mul(gate, up), d_dtype) if need_d else None, None
        prod, grad_gate, grad_up = _silu_mul_backward(gate, up, grad.matmul(wd), product=need_d)
        grad_d = _fused.weight_grad(grad, prod, d_dtype) if need_d else None
        del prod  # intermediate-width; not held through the input's gradient
        grad_x = grad_gate.matmul(wg) + grad_up.matmul(wu) if need_x else None
        return (grad_x.to(x_dtype) if grad_x is not None else None,
                _fused.weight_grad(grad_gate, xc, g_dtype) if need_g else None,
                _fused.weight_grad(grad_up, xc, u_dtype) if need_u else None,
                grad_d, None)


class _SiluMul(torch.autograd.Function):
    """h = silu(gate) ⊙ up. Saves gate and up (not silu(gate))."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return _silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        gate, up = ctx.saved_tensors
        _, grad_gate, grad_up = _silu_mul_backward(gate, up, grad, product=False)
        return (grad_gate if ctx.needs_input_grad[0] else None), (grad_up if ctx.needs_input_grad[1] else None)


def gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The fused MLP as a function. x (…, D); w_gate, w_up (I, D); w_down (D, I); dtype None: x's."""
    return _GatedMLP.apply(x, w_gate, w_up, w_down, dtype or x.dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return _SiluMul.apply(gate, up)


def _plain_linear(module: nn.Module) -> bool:
    return (type(module) is nn.Linear and module.bias is None
            and not (module._forward_hooks or module._forward_pre_hooks))


def _candidate(module: nn.Module) -> bool:
    """A gate/up/down MLP of plain bias-free linears (the class's forward is then probed once)."""
    projections = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return all(isinstance(p, nn.Module) and _plain_linear(p) for p in projections) \
        and isinstance(getattr(module, "act_fn", None), nn.Module)


def _reproduces(module: nn.Module) -> bool:
    """Whether `_GatedMLP` computes this module's own forward exactly: fp32, random input and weights."""
    probe = copy.deepcopy(module).float()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, probe.gate_proj.in_features, generator=gen).to(probe.gate_proj.weight.device)
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        for p in probe.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen).to(p.device))
        try:
            theirs = probe(x)
        except Exception:  # noqa: BLE001 - a forward we cannot call on its own is one we leave alone
            return False
        ours = gated_mlp(x, probe.gate_proj.weight, probe.up_proj.weight, probe.down_proj.weight)
    return isinstance(theirs, Tensor) and theirs.dtype == ours.dtype and torch.equal(theirs, ours)


def _forward(self: nn.Module, x: Tensor) -> Tensor:
    device = x.device.type
    if not (torch.is_autocast_enabled(device) and torch.is_grad_enabled()):
        return self._unfused_forward(x)
    dtype = torch.get_autocast_dtype(device)
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    if _plain_linear(gate) and _plain_linear(up) and _plain_linear(down):
        with torch.autocast(device, enabled=False):
            return gated_mlp(x, gate.weight, up.weight, down.weight, dtype)
    return down(silu_mul(gate(x), up(x)))  # adapters, quantized layers: their own linears, the product fused


def install(model: nn.Module) -> int:
    """Route every gated MLP of `model` that `_GatedMLP` reproduces through it (each module's own forward otherwise).
    Idempotent. Returns how many modules were switched. Their projections' weights are marked for bf16 copies
    (`weight_copies.want`): the optimizer keeps one of each beside it, which the forward reads instead of casting."""
    switched = _fused.install(model, marker="_fused_mlp", forward=_forward, candidate=_candidate, reproduces=_reproduces)
    for module in model.modules():
        if is_fused(module):
            for name in ("gate_proj", "up_proj", "down_proj"):
                weight_copies.want(getattr(module, name).weight)
    return switched


def is_fused(module: nn.Module) -> bool:
    return getattr(module, "_fused_mlp", False)
