"""The Llama family's attention for the training forward under autocast, its rotary embedding one autograd node.

`transformers`' attention rotates the query and key projections with `apply_rotary_pos_emb`: q·cos +
rotate_half(q)·sin, the bf16 projection times fp32 angles under autocast, so five elementwise passes over each
(tokens, heads, head_dim) tensor forward — two products promoted to fp32, a negation, a concatenation, a sum —
and as many again backward, with slice and select gradients written into zero-filled buffers. At DPO's
256-token pairs on tiny-30m that is 17.4 ms a layer, forward and backward, q and k together (1 thread,
`benchmarks/rope_kernel.py`). `_Rotary` is that rotation as one node: on a CPU, bf16 projections and fp32 angles
go through a C kernel one pass each way (`native/rope.py`: 2.1 ms a layer there); elsewhere the node runs
`transformers`' own ops forward and their gradient backward (the reference, and the fallback).

The forward is bit-identical: each element is the two products rounded to fp32 and their sum rounded once, as
PyTorch's two multiplies and one add compute it (kernels/rope.c keeps the compiler from fusing them), so the
rotated queries and keys, and everything after them, equal `transformers`' exactly
(tests/test_models_fused_attention.py: a whole model's logits with `torch.equal`). The backward sums the two
paths' gradients in fp32 and rounds once to bf16, where autograd rounds each to bf16 and adds them in bf16: the
two agree to bf16 round-off, and the kernel's sits closer to float64's.

`install(model)` switches each attention class whose own forward `_forward` reproduces exactly on a probe
(under bf16 autocast, random input, weights and angles, the eager attention) to a subclass of its own, as
`fused_norm` and `fused_mlp` do. `_forward` is the Llama attention's: the q/k/v projections (any linear,
LoRA adapters included), the rotation, the model's attention function (whichever `config._attn_implementation`
names at the call: eager, SDPA, the shared-prefix kernel), the output projection. A class with query/key norms
(Qwen3), a sliding window, partial rotary or anything else its probe shows different keeps its forward;
outside autocast, with autograd off, or with a KV cache (generation), every switched module runs its own.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from posttrain.models import _fused, weight_copies
from posttrain.native import rope


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_backward(g: Tensor) -> Tensor:
    """The gradient of `_rotate_half`'s input for `g` its output's: rotate_half's transpose."""
    half = g.shape[-1] // 2
    return torch.cat((g[..., half:], -g[..., :half]), dim=-1)


class _Rotary(torch.autograd.Function):
    """x (B, T, H·D), a projection's output; cos, sin (B or 1, T, D), not differentiated →
    x·cos + rotate_half(x)·sin per head, as (B, H, T, D), in the dtype PyTorch promotes x and cos to."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> Tensor:
        batch, tokens, _ = x.shape
        ctx.save_for_backward(cos, sin)
        ctx.head_dim, ctx.x_dtype = head_dim, x.dtype
        lib = rope.usable(x, cos, sin, head_dim)
        ctx.lib = lib
        if lib is not None:  # one pass in C (native/rope.py); the ops below are its reference
            out = rope.forward(lib, x, cos, sin, head_dim)
            return out.view(batch, tokens, -1, head_dim).transpose(1, 2)
        q = x.view(batch, tokens, -1, head_dim).transpose(1, 2)
        return (q * cos.unsqueeze(1)) + (_rotate_half(q) * sin.unsqueeze(1))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        cos, sin = ctx.saved_tensors
        head_dim = ctx.head_dim
        batch, heads, tokens, _ = grad.shape
        if ctx.lib is not None:
            grad_x = rope.backward(ctx.lib, grad.transpose(1, 2).reshape(batch, tokens, heads * head_dim), cos, sin,
                                   head_dim)
            return grad_x.to(ctx.x_dtype), None, None, None
        g = grad * cos.unsqueeze(1) + _rotate_half_backward(grad * sin.unsqueeze(1))
        return g.transpose(1, 2).reshape(batch, tokens, heads * head_dim).to(ctx.x_dtype), None, None, None


def rotary(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> Tensor:
    """A projection's output (B, T, H·D) rotated, as `transformers`' apply_rotary_pos_emb: (B, H, T, D)."""
    return _Rotary.apply(x, cos, sin, head_dim)


def _eager(module: nn.Module) -> Callable | None:
    """The eager attention function of the module's own family (its modeling file's)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _candidate(module: nn.Module) -> bool:
    """A q/k/v/o attention with a rotary embedding, no query/key norms and no sliding window (its class's
    forward is then probed once)."""
    return (all(isinstance(getattr(module, n, None), nn.Module) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and isinstance(getattr(module, "head_dim", None), int) and isinstance(getattr(module, "scaling", None), float)
            and hasattr(module, "config") and hasattr(module, "attention_dropout") and _eager(module) is not None
            and getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None) is not None
            and not hasattr(module, "q_norm") and not hasattr(module, "k_norm")
            and getattr(module, "sliding_window", None) is None)


def _reproduces(module: nn.Module) -> bool:
    """Whether `_forward` computes this module's own forward exactly: under bf16 autocast with autograd on (where
    it takes over), random input, weights and rotary angles, the eager attention over a causal mask."""
    probe = copy.deepcopy(module).float().train(False)
    probe.config = copy.deepcopy(module.config)
    probe.config._attn_implementation = "eager"
    device = next(probe.parameters()).device
    hidden = probe.q_proj.in_features if hasattr(probe.q_proj, "in_features") else probe.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    tokens, d = 7, probe.head_dim
    x = torch.randn(2, tokens, hidden, generator=gen).to(device)
    angles = torch.randn(2, tokens, d // 2, generator=gen) * 20
    emb = torch.cat((angles, angles), -1).to(device)
    position = (emb.cos(), emb.sin())
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None].expand(2, 1, tokens, tokens).to(device)
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen).to(p.device))
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16), torch.enable_grad():
            theirs = type(module).forward(probe, x, position, mask)[0]
            ours = _forward(probe, x, position, mask)[0]
    except Exception:  # noqa: BLE001 - a forward we cannot call on its own is one we leave alone
        return False
    return isinstance(theirs, Tensor) and theirs.dtype == ours.dtype and torch.equal(theirs, ours)


def _forward(self: nn.Module, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor] | None = None,
             attention_mask: Tensor | None = None, **kwargs) -> tuple[Tensor, Tensor | None]:
    device = hidden_states.device.type
    if (position_embeddings is None or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
            or not (torch.is_autocast_enabled(device) and torch.is_grad_enabled())):
        return self._unfused_forward(hidden_states, position_embeddings, attention_mask, **kwargs)
    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    cos, sin = position_embeddings
    # each projection reads its weight's bf16 copy where the optimizer keeps a current one (models/weight_copies.py)
    query = rotary(weight_copies.linear(self.q_proj, hidden_states), cos, sin, self.head_dim)
    key = rotary(weight_copies.linear(self.k_proj, hidden_states), cos, sin, self.head_dim)
    value = weight_copies.linear(self.v_proj, hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, _eager(self))
    out, weights = attention(self, query, key, value, attention_mask,
                             dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
    return weight_copies.linear(self.o_proj, out.reshape(*input_shape, -1).contiguous()), weights


def install(model: nn.Module) -> int:
    """Route every attention of `model` whose class `_forward` reproduces through it (each module's own forward
    otherwise). Idempotent. Returns how many modules were switched. Their projections' weights are marked for bf16
    copies (`weight_copies.want`), which the forward reads instead of casting where the optimizer keeps them."""
    switched = _fused.install(model, marker="_fused_attention", forward=_forward, candidate=_candidate,
                              reproduces=_reproduces)
    for module in model.modules():
        if is_fused(module):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                projection = getattr(module, name)
                if type(projection) is nn.Linear:
                    weight_copies.want(projection.weight)
    return switched


def is_fused(module: nn.Module) -> bool:
    return getattr(module, "_fused_attention", False)
