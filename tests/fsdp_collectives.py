"""One rank of tests/test_distributed_fsdp.py's 2-process gloo check of the FSDP2 pieces (spawned; imports
torch, transformers' tiny Llama and posttrain.distributed only, so a child starts in seconds)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as tdist

from posttrain.distributed import World
from posttrain.distributed.fsdp import (
    full_state_dict,
    gradient_norm,
    gradient_sync,
    idle_backward,
    is_sharded,
    load_shards,
    save_shards,
    shard_model,
)


def tiny_model():
    from posttrain.models import build_tiny

    return build_tiny("tiny-1m", vocab_size=300, seed=0, pad_token_id=0, eos_token_id=1)


def batch_loss(model, ids: torch.Tensor, rows: list[int], total_rows: int) -> torch.Tensor:
    """Mean log-likelihood of every token over the WHOLE batch's rows: each micro-batch's share of it,
    so the shares sum to the batch's loss (the normalization our losses use)."""
    logp = model(input_ids=ids[rows]).logits.float().log_softmax(-1)
    return -logp.gather(-1, ids[rows].unsqueeze(-1)).sum() / (total_rows * ids.shape[1])


def fsdp_pieces(rank: int, port: int, folder: str) -> None:
    """Rank `rank` of 2: the sharded gradient is the one-process gradient (summed, not averaged), with
    one reduce-scatter per step; an idle backward adds nothing; the gathered weights are the plain
    model's; sharded state saved at 2 ranks loads into one process."""
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    w = World(rank=rank, world_size=2, local_rank=rank, backend="gloo", owns_group=True)
    try:
        torch.manual_seed(0)
        ids = torch.randint(2, 300, (4, 10))  # the same 4 rows on both ranks (same seed)
        plain, model = tiny_model(), tiny_model()
        for rows in ([0, 1], [2, 3]):  # one process: the whole batch in 2 micro-batches
            batch_loss(plain, ids, rows, 4).backward()
        assert not is_sharded(model)
        shard_model(model, w)
        assert is_sharded(model)
        # this rank's 2 micro-batches of 1 row, gradients synced after the second only, then one idle
        # backward each rank (zero loss) after a third sync-off pass would be wrong: run it before the last
        mine = [[0], [1]] if rank == 0 else [[2], [3]]
        gradient_sync(model, False)
        idle_backward(model, torch.device("cpu"))  # adds 0 to every gradient
        for i, rows in enumerate(mine):
            gradient_sync(model, i == len(mine) - 1)
            batch_loss(model, ids, rows, 4).backward()
        whole = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        ref = {n: p.grad for n, p in plain.named_parameters()}
        diff = max(float((whole[n] - ref[n]).abs().max()) for n in ref)
        scale = max(float(g.abs().max()) for g in ref.values())
        # a mean over 2 ranks would be half the one-process gradient: a difference of scale / 2 ≫ 1e-5 · scale
        assert diff <= 1e-5 * scale, (diff, scale)
        norm = float(gradient_norm([p.grad for p in model.parameters()]))
        ref_norm = float(torch.nn.utils.get_total_norm(list(ref.values())))
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)

        # the gathered weights are the plain model's (no step taken yet), tied LM head and embedding one tensor
        sd = full_state_dict(model)
        assert sd.keys() == plain.state_dict().keys()
        assert all(torch.equal(sd[k], v) for k, v in plain.state_dict().items())
        if plain.config.tie_word_embeddings:
            assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]

        # one AdamW step on the shards, saved sharded; rank 0 then loads it into a plain model (below, alone)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        opt.step()
        save_shards(model, opt, Path(folder))
        torch.save(full_state_dict(model), Path(folder) / f"whole-{rank}.pt")
    finally:
        w.close()
    if rank == 0:  # no process group any more: one process, plain model, loads the 2 ranks' shards
        one = tiny_model()
        opt = torch.optim.AdamW(one.parameters(), lr=1e-2, foreach=False)
        load_shards(one, opt, Path(folder))
        saved = torch.load(Path(folder) / "whole-0.pt")
        assert all(torch.equal(one.state_dict()[k], saved[k]) for k in saved)
        assert all(int(s["step"]) == 1 for s in opt.state.values()) and len(opt.state) == len(list(one.parameters()))
