"""Which process of a data-parallel run this is, and the collectives on the scalars a stage logs.

`torchrun --nproc-per-node N -m posttrain.cli run …` starts N processes and tells each its place in
the environment: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, and `MASTER_ADDR` / `MASTER_PORT` for the `env://`
rendezvous. `init_world` reads them and joins the process group (gloo on a CPU, NCCL on CUDA). Without
them — a plain `posttrain run` — it returns the one-process world and creates no process group; every
collective of `World` is then the identity and costs nothing.

Every collective is a synchronization point: each rank must call it, in the same order, with the same
keys (values are reduced in float64, keys sorted, so the layout never depends on dict order).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as tdist

ENV_TIMEOUT = "POSTTRAIN_DIST_TIMEOUT_S"  # seconds a collective waits for the other ranks (default 1800)


class DistributedError(ValueError):
    """A data-parallel launch that cannot run: an incomplete torchrun environment, or a recipe or stage
    that does not run data-parallel."""


@dataclass(frozen=True)
class World:
    """This process's place in the run. The default is the one-process world (no process group)."""

    rank: int = 0  # 0 … world_size − 1; rank 0 is the one that writes the run folder
    world_size: int = 1
    local_rank: int = 0  # rank on this machine: which GPU a CUDA rank uses
    backend: str | None = None  # "gloo" | "nccl"; None: one process, no process group
    owns_group: bool = False  # init_world created the process group (close() destroys it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, name: str) -> torch.device:
        """The recipe's device for this rank: a bare "cuda" is this rank's GPU (`cuda:<local_rank>`)."""
        d = torch.device(name)
        if d.type == "cuda" and d.index is None and self.world_size > 1:
            return torch.device("cuda", self.local_rank)
        return d

    @property
    def comm_device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        """Wait until every rank is here (e.g. rank 0 has published a checkpoint the others read next)."""
        if self.world_size > 1:
            tdist.barrier()

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the ranks."""
        return self._reduce(values, tdist.ReduceOp.SUM)

    def max(self, values: dict[str, float]) -> dict[str, float]:
        """Each value's maximum over the ranks."""
        return self._reduce(values, tdist.ReduceOp.MAX)

    def mean(self, values: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
        """Σ_r w_r·v_r / Σ_r w_r per key, e.g. a mean over rows weighted by each rank's rows. A key whose
        weights sum to 0 (nothing to average anywhere) is left out. One process: the values themselves."""
        if self.world_size == 1:
            return {k: v for k, v in values.items() if weights[k] > 0}
        both = self.sum({**{f"v:{k}": weights[k] * v if weights[k] > 0 else 0.0 for k, v in values.items()},
                         **{f"w:{k}": float(weights[k]) for k in values}})
        return {k: both[f"v:{k}"] / both[f"w:{k}"] for k in values if both[f"w:{k}"] > 0}

    def _reduce(self, values: dict[str, float], op: tdist.ReduceOp) -> dict[str, float]:
        if self.world_size == 1:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.comm_device)
        tdist.all_reduce(t, op=op)  # a sync point with every rank
        out = dict(zip(keys, t.tolist()))
        return {k: out[k] for k in values}

    def close(self, *, clean: bool = False) -> None:
        """Leave the process group, if init_world created it. `clean`: every rank ended its run without an
        error, so all of them reach this call; they meet at a barrier first, and no rank tears its
        connections down while a peer's collectives may still use them (one CI run saw a gloo rank abort,
        "terminate called without an active exception", as it left the group right after training; the
        cause was not reproduced in 12 runs since). After an error only this rank leaves, without waiting."""
        if self.owns_group and tdist.is_initialized():
            if clean:
                tdist.barrier()
            tdist.destroy_process_group()


def _int_env(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise DistributedError(f"WORLD_SIZE is set but {name} is not: start data-parallel runs with torchrun "
                               f"(torchrun --nproc-per-node N -m posttrain.cli run RECIPE), which sets RANK, "
                               f"WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r}: expected an integer") from None


def init_world(device: str = "cpu") -> World:
    """This process's World, from torchrun's environment; the one-process World without it.

    `device`: the recipe's device — a CPU run joins a gloo group, a CUDA run an NCCL group (and each
    rank uses GPU `LOCAL_RANK`). An existing process group (a caller that made its own) is joined as
    it is, and left to its owner. Raises DistributedError on an incomplete or inconsistent environment."""
    if "WORLD_SIZE" not in os.environ:
        return World()
    size = _int_env("WORLD_SIZE")
    rank = _int_env("RANK")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if size < 1 or not 0 <= rank < size:
        raise DistributedError(f"RANK={rank}, WORLD_SIZE={size}: expected 0 ≤ RANK < WORLD_SIZE")
    if size == 1:
        return World()  # `torchrun --nproc-per-node 1`: one process; a group would only add a rendezvous
    if tdist.is_initialized():
        if (tdist.get_rank(), tdist.get_world_size()) != (rank, size):
            raise DistributedError(f"the process group is rank {tdist.get_rank()} of {tdist.get_world_size()}, "
                                   f"the environment says rank {rank} of {size}")
        return World(rank, size, local_rank, str(tdist.get_backend()), owns_group=False)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise DistributedError(f"WORLD_SIZE={size} but {' and '.join(missing)} not set: start data-parallel runs "
                               f"with torchrun, which sets them")
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=float(os.environ.get(ENV_TIMEOUT, 1800)))
    tdist.init_process_group(backend, init_method="env://", rank=rank, world_size=size, timeout=timeout)
    return World(rank, size, local_rank, backend, owns_group=True)
