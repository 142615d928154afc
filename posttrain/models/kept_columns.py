"""The last decoder layer computed only at the columns whose logits are read.

A packed forward (`stages/_packing.shared_prompt_logprobs`: GRPO's update and reference, DPO's pairs) reads
logits at a subset of its columns: each prompt's last column and every completion column but the last. In a
Llama-family decoder layer a column's output is its residual, plus the attention output projected (the
attention reads every column's keys and values), plus the MLP of that sum normalised; after the attention
nothing mixes columns. So in the last layer, whose outputs feed only the final norm and the LM head, the
output projection, both residual adds, the second norm and the MLP at every other column are work whose
result nobody reads: a shared prompt's columns but its last. On tiny-30m that is 1.5% of the linear layers'
FLOPs at the scaling benchmark's 64-token DPO pairs, 1.3% at 256, 1.2% at 1,024, and 0.6% at GRPO's 32-token
completions (/tmp arithmetic over the benchmark's pairs; measured: docs/performance.md).

Inside `kept_columns(model, keep)` the model's last decoder layer computes its norm, queries, keys, values and
attention at every column as before, and the rest at `keep` only, in `keep`'s order: the model's hidden states,
and so its logits, are then those of `keep` (call it with `logits_to_keep=0`). The restructured forward is
`_forward`; a layer class takes it only where it computes the class's own forward exactly (`_reproduces`, once
per class: fp32, random weights, input and rotary angles, eager attention over a causal mask, every column kept).
A layer it does not reproduce, one under activation checkpointing (its backward runs the forward again, after
the block has ended) and a sharded one keep their own forward, and the block yields False.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

_VERDICT: dict[type, bool] = {}


def _forward(layer: nn.Module, hidden_states: Tensor, keep: Tensor, **kwargs) -> Tensor:
    """A Llama-family decoder layer's forward with everything after the attention at columns `keep` of dim 1."""
    residual = hidden_states.index_select(1, keep)
    select = layer.self_attn.o_proj.register_forward_pre_hook(lambda _m, args: (args[0].index_select(1, keep), *args[1:]))
    try:
        attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
    finally:
        select.remove()
    hidden_states = residual + attended
    return hidden_states + layer.mlp(layer.post_attention_layernorm(hidden_states))


def _candidate(layer: nn.Module) -> bool:
    attn = getattr(layer, "self_attn", None)
    return (all(isinstance(getattr(layer, n, None), nn.Module)
                for n in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))
            and isinstance(getattr(attn, "o_proj", None), nn.Module) and isinstance(getattr(attn, "head_dim", None), int)
            and hasattr(attn, "config"))


def _reproduces(layer: nn.Module) -> bool:
    """Whether `_forward` with every column kept computes `layer`'s own forward exactly (fp32, eager attention
    over a causal mask, random weights, input and rotary angles)."""
    probe = copy.deepcopy(layer).float().train(False)
    probe.self_attn.config = copy.deepcopy(layer.self_attn.config)
    probe.self_attn.config._attn_implementation = "eager"
    device = next(probe.parameters()).device
    gen = torch.Generator().manual_seed(0)
    tokens, d, hidden = 7, probe.self_attn.head_dim, probe.self_attn.config.hidden_size
    x = torch.randn(1, tokens, hidden, generator=gen).to(device)
    angles = torch.randn(1, tokens, d // 2, generator=gen) * 20
    emb = torch.cat((angles, angles), -1).to(device)
    kwargs = {"attention_mask": torch.full((tokens, tokens), float("-inf")).triu(1)[None, None].to(device),
              "position_embeddings": (emb.cos(), emb.sin()), "position_ids": torch.arange(tokens, device=device)[None]}
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen).to(p.device))
        try:
            theirs = probe(x, **kwargs)
            theirs = theirs[0] if isinstance(theirs, tuple) else theirs
            ours = _forward(probe, x, torch.arange(tokens, device=device), **kwargs)
        except Exception:  # noqa: BLE001 - a layer we cannot call on its own is one we leave alone
            return False
    return isinstance(theirs, Tensor) and theirs.shape == ours.shape and torch.equal(theirs, ours)


def _last_layer(model: nn.Module) -> nn.Module | None:
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        return None
    layers = getattr(decoder, "layers", None)
    count = getattr(getattr(decoder, "config", None), "num_hidden_layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return None
    return layers[: count][-1] if isinstance(count, int) and count > 0 else layers[-1]


def usable(model: nn.Module) -> nn.Module | None:
    """`model`'s last decoder layer where `kept_columns` can restructure it, else None."""
    layer = _last_layer(model)
    if layer is None or not _candidate(layer) or "forward" in vars(layer):
        return None
    if getattr(layer, "gradient_checkpointing", False) and layer.training:
        return None  # its backward runs the forward again, outside the block
    if any(type(p.data) is not torch.Tensor for p in layer.parameters()):
        return None  # sharded (DTensor) or otherwise wrapped parameters
    cls = type(layer)
    if cls not in _VERDICT:
        _VERDICT[cls] = _reproduces(layer)
    return layer if _VERDICT[cls] else None


@contextmanager
def kept_columns(model: nn.Module, keep: Tensor) -> Iterator[bool]:
    """Inside the block, `model`'s last decoder layer returns its hidden states at columns `keep` (1-D, of the
    one packed row) only: the model's logits are then `keep`'s. Yields whether it does (False: the model is
    unchanged, and the caller selects the columns itself)."""
    layer = usable(model)
    if layer is None:
        yield False
        return
    layer.forward = functools.partial(_forward, layer, keep=keep)
    try:
        yield True
    finally:
        del layer.forward
