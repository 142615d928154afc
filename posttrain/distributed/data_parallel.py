"""Data parallelism by summing gradients: each rank's share of a global batch, the step's gradient summed
over the ranks, and a check that the replicas still hold the same weights.

Every rank holds the whole model and the same optimizer state, draws the same global batch (same
seed, same sampler), runs the forward and backward of its share only, and then the gradients are
summed over the ranks, so every rank takes the identical optimizer step. The losses are normalized by
counts over the WHOLE global batch (tokens, sequences; `posttrain.losses.aggregation`), so the sum of
the ranks' gradients is the gradient one process computes over the same batch — up to the order of
float additions.

Departures from `torch.nn.parallel.DistributedDataParallel` (DDP), and why:
1. Gradients are all-reduced once per optimizer step, after the last micro-batch's backward
   (`all_reduce_gradients`), instead of in buckets overlapped with the backward. Gradient
   accumulation then needs no `no_sync()`: micro-batches accumulate locally and nothing is
   communicated until the step's end — what DDP's `no_sync` achieves. The price is the overlap: the
   all-reduce waits for the whole backward (on a GPU with a large model, DDP hides most of it).
2. SUM, not DDP's mean: the losses are already normalized over the global batch; a mean would need
   every loss multiplied by the world size first (exact only for powers of two).
3. No wrapper module: the stages call the model in several ways (`model(...)`, inside
   `models.prefix_attention.shared_prefix(model)`, which reads `model.config`; through PEFT; the
   rollout engine holds the same module), which a DDP wrapper would have to be threaded through. And a
   rank may hold no rows at all in an RL step (every local group dropped): it contributes zeros here,
   where DDP would need a dummy forward or `Join`.
4. No broadcast of the initial weights: every rank loads the same checkpoint; `check_replicas_agree`
   (at every checkpoint) fails loudly if the replicas ever drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as tdist

from posttrain.distributed.world import World

T = TypeVar("T")


def shard_range(n: int, world: World) -> range:
    """The indices of this rank's contiguous block of `n` items (`n` must divide by the world size).

    >>> shard_range(8, World(rank=1, world_size=2))
    range(4, 8)"""
    if n % world.world_size:
        raise ValueError(f"{n} items do not split evenly over {world.world_size} ranks")
    per = n // world.world_size
    return range(world.rank * per, (world.rank + 1) * per)


def shard(items: Sequence[T], world: World) -> list[T]:
    """This rank's contiguous block of `items` (their count must divide by the world size)."""
    return [items[i] for i in shard_range(len(items), world)]


def deal(items: Sequence[T], world: World) -> list[T]:
    """This rank's items dealt round-robin: items r, r + W, r + 2W, … (W ranks). For items sorted by
    cost (length-grouped micro-batches) every rank gets cheap and expensive ones alike."""
    return list(items[world.rank :: world.world_size])


def all_reduce_gradients(world: World, model: torch.nn.Module) -> None:
    """Sum every trainable parameter's gradient over the ranks, in place — one all-reduce per dtype.

    A rank that has no gradient for a parameter (it held no rows, or the parameter took no part in
    its forward) contributes zeros; a parameter no rank has a gradient for keeps `grad = None`, as in
    one process (so AdamW skips it there too). A sync point with every rank; identity in one process."""
    if world.world_size == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), ps in groups.items():
        present = torch.tensor([float(p.grad is not None) for p in ps], dtype=dtype, device=device)
        # one flat buffer: the gradients, then one "had a gradient" count per parameter
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps] + [present])
        tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)  # a sync point with every rank
        offset = 0
        counts = flat[-len(ps):].tolist()
        for p, count in zip(ps, counts):
            g = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if count == 0:
                continue
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)


def check_replicas_agree(world: World, model: torch.nn.Module, where: str) -> None:
    """Raise if the ranks' weights differ: a fingerprint per parameter (the float64 sum and sum of
    absolute values), compared by all-reducing its maximum and its minimum. Identical updates of
    identical weights keep the replicas bitwise equal, so any difference is a bug worth stopping for.
    Two all-reduces of 2 numbers per parameter; identity in one process."""
    if world.world_size == 1:
        return
    named = [(n, p) for n, p in model.named_parameters()]
    fp = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().abs().sum()]) for _, p in named])
    fp = fp.reshape(-1).to(world.comm_device)
    hi, lo = fp.clone(), fp.clone()
    tdist.all_reduce(hi, op=tdist.ReduceOp.MAX)
    tdist.all_reduce(lo, op=tdist.ReduceOp.MIN)
    same = (hi == lo) | (hi.isnan() & lo.isnan())
    if not bool(same.all()):
        first = int((~same).nonzero()[0, 0]) // 2
        raise RuntimeError(f"{where}: the {world.world_size} ranks hold different weights, first at {named[first][0]} "
                           f"(fingerprint {float(lo[2 * first])!r} … {float(hi[2 * first])!r}); "
                           f"the data-parallel replicas drifted apart")
