"""FSDP2: the training model's parameters, gradients and AdamW state sharded over the ranks
(`torch.distributed.fsdp.fully_shard`), and the state dicts that move between shards and whole tensors.

Follows the FSDP2 recipe of the PyTorch docs (fully_shard each transformer block, then the root): each
decoder layer is one all-gather/reduce-scatter unit, the root holds what is left (embeddings, final
norm, LM head; a tied LM head shares the embedding's unit). Departures, and why:
1. Gradients are SUMMED over the ranks, not averaged: `set_gradient_divide_factor(1.0)` with
   `set_force_sum_reduction_for_comms(True)` makes the reduce-scatter a plain ReduceOp.SUM (gloo has
   no PREMUL_SUM/AVG; NCCL then runs the same SUM). Our losses are normalized over the whole global
   batch (`losses/aggregation.py`), so the sum of the ranks' gradients is the one-process gradient —
   the same contract as the replicated path (`data_parallel.all_reduce_gradients`).
2. Gradient accumulation reduces once per optimizer step: `gradient_sync(model, last)` turns the
   reduce-scatter off for every micro-batch but the last (`set_requires_gradient_sync(False)`), so the
   micro-batches accumulate unsharded, local gradients and the last backward reduce-scatters their sum
   — FSDP1's `no_sync`. Chosen over reduce-scattering every micro-batch because it adds the
   gradients in the order the replicated path does (local micro-batches first, then the ranks), and
   it moves 1/k of the bytes; the cost is one full (unsharded) gradient per rank between micro-batches.
3. Every rank must run the same number of forwards and backwards (each one all-gathers): a rank with
   fewer micro-batches runs `idle_backward`s (zero loss, zero gradient) to keep the collectives paired.
4. Readers of the whole weights — the rollout engine, the HF-format `final` checkpoint, evals — get
   them from `full_state_dict` (an all-gather of every parameter, on every rank: a collective); the
   rollout engine samples from its own unsharded copy, loaded at each `sync` (docs/distributed.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.distributed.world import World


def is_sharded(model: nn.Module) -> bool:
    """True when `model` was passed through `shard_model` (its parameters are DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (`model.model.layers` in Llama/Qwen/SmolLM-style models,
    `transformer.h` in GPT-2 style ones). Raises ValueError naming the class when none are found."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj):
            return list(obj)
    raise ValueError(f"fsdp: found no decoder layers in {type(model).__name__} (looked for model.layers, "
                     f"transformer.h, gpt_neox.layers, model.decoder.layers); use strategy: replicate")


def shard_model(model: nn.Module, world: World) -> nn.Module:
    """`fully_shard` each decoder layer, then the root, over all ranks (one 1-D device mesh), gradients
    reduced by SUM (departure 1). In place; returns `model`. Needs a process group (world_size > 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if world.world_size == 1:
        raise ValueError("shard_model: one process has nothing to shard over (the fsdp strategy runs the plain model there)")
    mesh = init_device_mesh(world.comm_device.type, (world.world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # departure 1: SUM, not the mean
    for m in model.modules():  # the factor is per FSDP state; the comms flag too
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def gradient_sync(model: nn.Module, on: bool) -> None:
    """Whether the next backward reduce-scatters the gradients (departure 2): off for every micro-batch
    but the last. No-op for an unsharded model (the replicated path reduces once, after the last)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(on)  # type: ignore[operator]


def idle_backward(model: nn.Module, device: torch.device) -> None:
    """A forward and backward that contributes a zero gradient: a rank with fewer micro-batches than the
    others runs these so that every all-gather and reduce-scatter has all ranks (departure 3)."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    (model(input_ids=ids).logits.sum() * 0.0).backward()


def full_state_dict(model: nn.Module, *, cpu: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole (unsharded), keyed as in the plain model. Sharded: an all-gather
    per tensor on every rank — a collective every rank must call. Plain: the model's own state dict
    (no copy). `cpu`: copies on the CPU (for a GPU rank that writes the HF checkpoint)."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}  # tied weights (an LM head tied to the embedding) stay one tensor,
    owner = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}  # tied names: one Parameter
    for name, value in model.state_dict().items():  # as save_pretrained expects them: one storage
        key = owner.get(name, id(value))  # the same on every rank, so every rank gathers the same tensors
        if key not in gathered:
            whole = value.full_tensor() if isinstance(value, DTensor) else value  # a sync point with every rank
            gathered[key] = whole.detach().cpu() if cpu else whole.detach()
        out[name] = gathered[key]
    return out


def gradient_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all `grads` as one plain tensor: sharded gradients' norm is reduced over the ranks
    (a sync point), so every rank sees the norm of the whole gradient, as one process does."""
    norm = torch.nn.utils.get_total_norm(grads)
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


# ---- sharded state through torch.distributed.checkpoint --------------------------------------------------
def save_shards(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Write the model's and the optimizer's state into `folder` through `torch.distributed.checkpoint`:
    every rank writes its own shards (`__<rank>_0.distcp`), rank 0 the `.metadata` that maps each
    tensor's pieces. Keys are the plain model's parameter names (`get_model_state_dict` /
    `get_optimizer_state_dict`), so any world size — one process included, sharded or not — loads it.
    A collective when there is a process group; `folder` must exist (rank 0 made it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=str(folder))


def load_shards(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load what `save_shards` wrote, resharded to this run's layout (another world size, or the plain
    model of one process): every rank reads the pieces of its own shards. The optimizer must have the
    model's parameters in the same groups as the run that saved it (`build_optimizer` makes them so)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(folder))  # fills the tensors of `state` in place
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


def load_whole_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load an optimizer state dict saved by a replicated run (`Optimizer.state_dict()`: keyed by each
    parameter's index in the groups, whole tensors) into `optimizer`, sharded or not. The indices are
    mapped to parameter names through this optimizer's own groups (same `build_optimizer`, same order),
    then `set_optimizer_state_dict` keeps each rank's shard of every tensor."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not is_sharded(model):
        optimizer.load_state_dict(saved)
        return
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    if len(order) != sum(len(g["params"]) for g in saved["param_groups"]):
        raise ValueError(f"the saved optimizer state has {sum(len(g['params']) for g in saved['param_groups'])} "
                         f"parameters, this model {len(order)}")
    by_name = {"state": {order[int(i)]: st for i, st in saved["state"].items()},
               "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
