"""Data-parallel training over torch.distributed (docs/distributed.md): which process of the run this is
(`World`, from torchrun's environment), each rank's share of a global batch, gradients summed over the
ranks, and logged scalars reduced over them. In one process every collective is the identity.
`posttrain.distributed.fsdp`: the FSDP2 strategy — the model sharded over the ranks, and the state dicts
that move between shards and whole tensors (torch.distributed.checkpoint)."""

from posttrain.distributed.data_parallel import all_reduce_gradients, check_replicas_agree, deal, shard, shard_range
from posttrain.distributed.world import DistributedError, World, init_world

__all__ = ["DistributedError", "World", "all_reduce_gradients", "check_replicas_agree", "deal", "init_world", "shard",
           "shard_range"]
