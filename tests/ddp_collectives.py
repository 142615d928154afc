"""One rank of tests/test_distributed.py's 2-process gloo check of the collectives (spawned; imports only
torch and posttrain.distributed, so a child starts in seconds)."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from posttrain.distributed import World, all_reduce_gradients, check_replicas_agree


def collectives(rank: int, port: int) -> None:
    """Rank `rank` of 2 (spawned): every collective checked against numbers worked out by hand."""
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    w = World(rank=rank, world_size=2, local_rank=rank, backend="gloo", owns_group=True)
    try:
        assert w.sum({"a": 1.0 + rank, "b": 10.0}) == {"a": 3.0, "b": 20.0}  # 1 + 2, 10 + 10
        assert w.max({"a": 1.0 + rank}) == {"a": 2.0}
        # rank 0: mean 0.5 over 2 rows; rank 1: 0.8 over 3 rows → (1.0 + 2.4) / 5 = 0.68; "c" is averaged
        # over rank 1 alone (rank 0 has nothing: weight 0); "d" nowhere → left out
        got = w.mean({"m": [0.5, 0.8][rank], "c": [0.0, 0.3][rank], "d": 0.0},
                     {"m": [2.0, 3.0][rank], "c": [0.0, 4.0][rank], "d": 0.0})
        assert set(got) == {"m", "c"} and abs(got["m"] - 0.68) < 1e-12 and abs(got["c"] - 0.3) < 1e-12

        model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 1, bias=False))
        with torch.no_grad():
            model[0].weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
            model[1].weight.fill_(1.0)
        check_replicas_agree(w, model, "start")  # same weights everywhere
        model[0].weight.grad = torch.full((2, 2), float(rank + 1))  # rank 0: ones, rank 1: twos
        model[1].weight.grad = torch.ones(1, 2) if rank == 1 else None  # rank 0 has none: contributes zeros
        all_reduce_gradients(w, model)
        assert torch.equal(model[0].weight.grad, torch.full((2, 2), 3.0))  # 1 + 2
        assert torch.equal(model[1].weight.grad, torch.ones(1, 2))  # 0 + 1, on rank 0 too
        model[1].weight.grad = None  # nobody has one: it stays None (AdamW skips it, as in one process)
        model[0].weight.grad = torch.zeros(2, 2)
        all_reduce_gradients(w, model)
        assert model[1].weight.grad is None

        if rank == 1:
            with torch.no_grad():
                model[1].weight[0, 1] += 1e-6  # one replica drifts
        try:
            check_replicas_agree(w, model, "step 3")
        except RuntimeError as e:
            assert "step 3: the 2 ranks hold different weights, first at 1.weight" in str(e)
        else:
            raise AssertionError("drifted replicas were not noticed")
    finally:
        w.close()
