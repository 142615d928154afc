"""Attention for rows that share a prefix: [prefix | s_1 | … | s_G], each slot seeing the prefix and itself.

GRPO scores G completions of one prompt; a padded batch runs the prompt G times through every matmul.
Laid out as one row per group — the prompt once (P positions, left-padded), then G slots of N
positions each (a completion, right-padded) — the matmuls run P + G·N tokens instead of G·(P + N).
The attention must then keep the sequences apart: slot j attends to the prompt and causally to its
own tokens, never to another slot. A dense (P + G·N)² mask does that through any attention kernel,
but computes and masks G² blocks to keep G of them (on tiny-30m with 22-token prompts and 8 × 32-token
slots the masked softmax and its backward cost about as much as the matmuls saved). This kernel
computes only the blocks that are read:

    prefix queries  (P)  × prefix keys (P), causal, pads masked              — once per row
    slot-j queries  (N)  × [prefix keys (P) | slot-j keys (N), causal]       — G times per row

which is exactly the attention each sequence has in its own padded row (same keys, same order, the
same scale and fp32 softmax as `transformers`' eager attention), so logits and gradients equal the
padded forward's up to round-off (tests/test_models_prefix_attention.py; the naive reference is the
padded forward itself).

It plugs into `transformers` through its `AttentionInterface`: `shared_prefix(model)` switches the
model's attention to this kernel for one forward, which then takes `prefix_len=` and `slots=` as
keyword arguments (transformers passes unknown forward kwargs down to the attention function) and a
4-D boolean `attention_mask` of shape (R, 1, 1, W) marking real tokens (a 4-D mask skips transformers'
own mask construction). Positions are the caller's: slot tokens continue from the prompt's length.

Cost: the slot keys are [prefix | own] copies, (R, Hkv, G, P + N, D) per layer — small next to the
activations; GQA groups the query heads of one KV head into the rows of one matmul (no repeat_kv).

Two ways to compute each product, picked by its key length:
- short (fewer than `SDPA_FROM` keys): two matmuls and an fp32 softmax, as above. The probabilities
  (queries × keys, fp32) are kept for the backward — cheap at these lengths, and faster than a fused
  kernel's blocking overhead;
- long: `F.scaled_dot_product_attention` with a boolean mask over the same blocks (PyTorch's fused
  flash kernel on a CPU and on CUDA where it takes a mask; it keeps one log-sum-exp per query, not the
  probabilities — at 512-token completions the kept fp32 probabilities were 1.4 GB on tiny-30m).
Both compute the same attention (tests/test_models_prefix_attention.py: fp32 within round-off).
Measured (`python benchmarks/prefix_attention.py`, one attention call forward + backward, bf16, 1
thread): docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

NAME = "posttrain_shared_prefix"
# keys per query at or above which a product goes through SDPA (docs above; the crossover measured by
# benchmarks/prefix_attention.py on this project's CPU lies between 144 and 256 keys)
SDPA_FROM = 256


def _sdpa(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor, scaling: float, dropout: float,
          training: bool) -> Tensor:
    """Fused attention of (B, Hq, L, D) queries over (B, Hkv, S, D) keys under a (B, 1, L, S) boolean mask
    (True: may attend). GQA through `enable_gqa` (no repeated keys)."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling,
                                          dropout_p=dropout if training else 0.0, enable_gqa=True)


def _softmax_probs(scores: Tensor, bias: Tensor, scaling: float, dtype: torch.dtype, dropout: float,
                   training: bool) -> Tensor:
    """softmax(scores · scale + bias) in fp32, cast back to the value dtype (as HF's eager attention)."""
    probs = torch.softmax(scores.float() * scaling + bias, dim=-1).to(dtype)
    return F.dropout(probs, p=dropout, training=training) if dropout > 0 else probs


def shared_prefix_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor,
                            scaling: float, dropout: float = 0.0, *, prefix_len: int, slots: int,
                            **kwargs) -> tuple[Tensor, None]:
    """The attention function (transformers' signature). Shapes: query (R, Hq, W, D); key, value
    (R, Hkv, W, D) with W = prefix_len + slots · N; attention_mask (R, 1, 1, W) bool, True on real
    tokens. Returns (R, W, Hq, D) and no weights."""
    rows, hq, width, d = query.shape
    hkv, p, g = key.shape[1], prefix_len, slots
    n = (width - p) // g
    if p < 1 or p + g * n != width:
        raise ValueError(f"shared_prefix_attention: width {width} is not prefix_len {p} + slots {g} × N")
    group = hq // hkv
    real = attention_mask.reshape(rows, width)
    dev, f32 = query.device, torch.float32
    q = query.view(rows, hkv, group, width, d)

    # prefix × prefix: causal; a pad (left padding) sees only itself, so no softmax row is empty
    causal_p = torch.ones(p, p, dtype=torch.bool, device=dev).tril()
    allowed = (causal_p & real[:, None, :p]) | (torch.eye(p, dtype=torch.bool, device=dev) & ~real[:, :p, None])
    kp, vp = key[:, :, :p], value[:, :, :p]                                             # (R, Hkv, P, D)
    if p >= SDPA_FROM:
        out_p = _sdpa(query[:, :, :p], kp, vp, allowed[:, None], scaling, dropout, module.training)  # (R, Hq, P, D)
    else:
        bias_p = torch.zeros(allowed.shape, dtype=f32, device=dev).masked_fill_(~allowed, float("-inf"))  # (R, P, P)
        sp = torch.matmul(q[..., :p, :], kp[:, :, None].transpose(-1, -2))              # (R, Hkv, g, P, P)
        out_p = torch.matmul(_softmax_probs(sp, bias_p[:, None, None], scaling, value.dtype, dropout, module.training),
                             vp[:, :, None])                                             # (R, Hkv, g, P, D)

    # slot j × [prefix | slot j]: prefix pads masked, own tokens causal (a slot's right padding is
    # never seen by its real tokens; its own outputs are not read)
    causal_n = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    allowed_s = torch.cat([real[:, None, :p].expand(rows, n, p), causal_n.expand(rows, n, n)], dim=-1)  # (R, N, P + N)
    if p + n >= SDPA_FROM:  # each slot a batch entry: (R·G, Hq, N, D) over its (R·G, Hkv, P + N, D) keys
        qs = query[:, :, p:].reshape(rows, hq, g, n, d).transpose(1, 2).reshape(rows * g, hq, n, d)
        own = lambda t: t[:, :, p:].reshape(rows, hkv, g, n, d).transpose(1, 2)         # (R, G, Hkv, N, D)
        ks, vs = (torch.cat([t[:, None, :, :p].expand(rows, g, hkv, p, d), own(t)], dim=3).reshape(rows * g, hkv, p + n, d)
                  for t in (key, value))
        mask = allowed_s[:, None, None].expand(rows, g, 1, n, p + n).reshape(rows * g, 1, n, p + n)
        out_s = _sdpa(qs, ks, vs, mask, scaling, dropout, module.training)               # (R·G, Hq, N, D)
        out_s = out_s.reshape(rows, g, hq, n, d).transpose(1, 2)                         # (R, Hq, G, N, D)
    else:  # GQA: the query heads of one KV head are the rows of one matmul
        qs = q[..., p:, :].reshape(rows, hkv, group, g, n, d).transpose(2, 3).reshape(rows, hkv, g, group * n, d)
        own = lambda t: t[:, :, p:].reshape(rows, hkv, g, n, d)                         # (R, Hkv, G, N, D)
        ks = torch.cat([kp[:, :, None].expand(rows, hkv, g, p, d), own(key)], dim=3)     # (R, Hkv, G, P + N, D)
        vs = torch.cat([vp[:, :, None].expand(rows, hkv, g, p, d), own(value)], dim=3)
        bias_s = torch.zeros(allowed_s.shape, dtype=f32, device=dev).masked_fill_(~allowed_s, float("-inf"))
        ss = torch.matmul(qs, ks.transpose(-1, -2)).view(rows, hkv, g, group, n, p + n)
        probs = _softmax_probs(ss, bias_s[:, None, None, None], scaling, value.dtype, dropout, module.training)
        out_s = torch.matmul(probs.view(rows, hkv, g, group * n, p + n), vs)             # (R, Hkv, G, g·N, D)
        out_s = out_s.view(rows, hkv, g, group, n, d).transpose(2, 3)                    # (R, Hkv, g, G, N, D)

    out = torch.cat([out_p.reshape(rows, hq, p, d), out_s.reshape(rows, hq, g * n, d)], dim=2)  # (R, Hq, W, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, shared_prefix_attention)


@contextmanager
def shared_prefix(model: nn.Module) -> Iterator[None]:
    """Run `model`'s attention through `shared_prefix_attention` inside the block (its forward must then
    get `prefix_len=`, `slots=` and the (R, 1, 1, W) key mask). Autograd's backward needs no switch."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
