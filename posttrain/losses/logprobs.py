"""Per-token log-probabilities, entropy, and sequence log-probabilities under a mask.

Definition: for logits z ∈ R^V at one position and the token y actually there,
    log π(y) = z_y − logsumexp(z),        H = logsumexp(z) − Σ_v softmax(z)_v · z_v.
The naive route, `log_softmax(z).gather(y)`, materializes a (B, T, V) tensor of log-probs (and keeps it
for backward); at V = 150k and 8k tokens that is 4.9 GB in fp32, for the B·T numbers we want.

Alignment is the caller's: `logits[..., t, :]` are the scores for `tokens[..., t]` (for a causal LM,
pass `logits[:, :-1]` and `input_ids[:, 1:]`). Temperature, if sampling used one, is applied by the
caller to the logits first (`logits / temperature`), so the log-probs match the sampler's.

Departures from the naive reference `token_logprobs_naive`:
1. `token_logprobs` never builds the (B, T, V) log-softmax: it takes the logsumexp chunk by chunk over
   positions and gathers one logit per position; its backward recomputes softmax chunk by chunk from
   the logits the caller already holds, so autograd saves only the logits and a (B, T) logsumexp.
2. For fp16/bf16 logits it computes in fp32 and returns fp32: a bf16 log-prob of −7 is only resolved
   to ±0.016, which becomes a ±1.6% error in the PPO ratio exp(new − old). The naive reference stays
   in the input dtype, so the dtype test shows the difference.
3. On a CPU, bf16 and fp32 logits go through a C kernel (`native/logprobs.py`, kernels/logprobs.c): the
   same quantities in fp32 from two reads of each position's row forward and one backward, where the
   PyTorch ops below (the reference, and the fallback without a compiler or with
   `POSTTRAIN_C_KERNELS=0`) make a dozen passes over an fp32 copy; 4–8× faster at a 49k vocabulary
   (docs/performance.md, "The log-probs over the vocabulary"). Its e^x is a polynomial (relative
   error ~2e-7), so the two agree to fp32 round-off, not bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from posttrain.losses._masked import check_ndim, check_same_shape, masked_count, masked_sum
from posttrain.native import logprobs as native_logprobs

DEFAULT_CHUNK_SIZE = 1024  # positions per chunk: 1024 × 150k vocab × 4 B = 600 MB of fp32 scratch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 are upcast to fp32 (see departure 2); fp32 and fp64 stay as they are."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _blocks(rows: int, cols: int, chunk_size: int) -> list[tuple[slice, slice]]:
    """Tiles of a (rows, cols) grid of positions holding at most ~chunk_size positions each.

    Whole rows at a time when a row fits, else slices of one row. Tiling the (B, T) grid, rather than
    flattening it, keeps `logits[:, :-1]` (not contiguous) a view instead of a full copy.
    """
    if cols <= chunk_size:
        step = max(1, chunk_size // max(cols, 1))
        return [(slice(r, min(r + step, rows)), slice(0, cols)) for r in range(0, rows, step)]
    return [(slice(r, r + 1), slice(c, min(c + chunk_size, cols)))
            for r in range(rows) for c in range(0, cols, chunk_size)]


def _as_grid(logits: Tensor) -> Tensor:
    """(..., V) → (R, C, V): a view for (B, T, V) inputs, sliced or not; other ranks are reshaped."""
    return logits.reshape(-1, *logits.shape[-2:]) if logits.ndim >= 2 else logits.reshape(1, 1, -1)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """z_y − logsumexp(z) over a (R, C, V) grid, tile by tile; backward by recomputing softmax."""

    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor, tokens: Tensor, chunk_size: int) -> Tensor:
        # logits (R, C, V), tokens (R, C) → (R, C)
        lib = native_logprobs.usable(logits)
        ctx.lib, ctx.chunk_size = lib, chunk_size
        if lib is not None:
            out, lse, _ = native_logprobs.forward(lib, logits, tokens)
            ctx.save_for_backward(logits, tokens, lse)
            return out
        acc = _compute_dtype(logits.dtype)
        rows, cols = tokens.shape
        out = torch.empty(rows, cols, dtype=acc, device=logits.device)
        lse = torch.empty(rows, cols, dtype=acc, device=logits.device)
        for r, c in _blocks(rows, cols, chunk_size):
            block = logits[r, c].to(acc)  # (rows', cols', V) scratch, freed each iteration
            lse[r, c] = torch.logsumexp(block, dim=-1)
            out[r, c] = block.gather(-1, tokens[r, c, None]).squeeze(-1) - lse[r, c]
        ctx.save_for_backward(logits, tokens, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, tokens, lse = ctx.saved_tensors
        if ctx.lib is not None:
            return native_logprobs.backward(ctx.lib, logits, tokens, lse, grad_out), None, None
        acc = lse.dtype
        grad = torch.empty_like(logits)
        rows, cols = tokens.shape
        for r, c in _blocks(rows, cols, ctx.chunk_size):
            g = grad_out[r, c, None].to(acc)  # (rows', cols', 1)
            # d(z_y − lse)/dz = onehot(y) − softmax(z); one fresh (c, V) buffer, the rest in place
            block = logits[r, c].to(acc) - lse[r, c, None]
            block.exp_().mul_(-g)
            block.scatter_add_(-1, tokens[r, c, None], g)
            grad[r, c] = block.to(logits.dtype)
        return grad, None, None


def _check_logits_tokens(where: str, logits: Tensor, tokens: Tensor) -> None:
    if logits.ndim < 1 or logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"{where}: logits have shape {tuple(logits.shape)} and tokens {tuple(tokens.shape)}; "
            "expected logits (..., V) and tokens (...) with the same leading dims"
        )
    if not logits.is_floating_point():
        raise ValueError(f"{where}: logits must be floating point, got {logits.dtype}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{where}: tokens must be int64 or int32 ids, got {tokens.dtype}")
    if tokens.numel():
        # Device sync point; cheap next to the pass over the logits, and it turns a CUDA
        # device-side assert (or silent garbage) into a message.
        lo, hi = torch.aminmax(tokens)
        vocab = logits.shape[-1]
        if lo.item() < 0 or hi.item() >= vocab:
            raise ValueError(
                f"{where}: token ids span [{lo.item()}, {hi.item()}], expected [0, {vocab}) — "
                "replace label padding (e.g. -100) with any valid id and mask it out instead"
            )


def token_logprobs(logits: Tensor, tokens: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """log π(tokens) from logits without materializing the log-softmax.

    Shape: logits (..., V), tokens (...) → (...). dtype: fp32 for fp16/bf16 logits, else the logits'.
    Differentiable with respect to `logits` (first order).
    """
    _check_logits_tokens("token_logprobs", logits, tokens)
    if chunk_size < 1:
        raise ValueError(f"token_logprobs: chunk_size must be >= 1, got {chunk_size}")
    lead = tokens.shape
    grid_logits = _as_grid(logits)
    grid_tokens = tokens.long().reshape(grid_logits.shape[:2])
    return _ChunkedTokenLogprobs.apply(grid_logits, grid_tokens, chunk_size).reshape(lead)


class _RowTokenLogprobs(torch.autograd.Function):
    """z[rows[j], tokens[j]] − logsumexp(z[rows[j]]) over (K, V) logits: each row's normaliser once; the backward
    writes every row's gradient, −(Σ g)·softmax plus each token's g, in one pass — through the C kernel, or
    PyTorch ops chunk by chunk of rows (fp32 scratch of `chunk_size` rows). No (M, V) copy of the rows read."""

    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor, rows: Tensor, tokens: Tensor, lib, chunk_size: int) -> Tensor:
        acc = _compute_dtype(logits.dtype)
        if lib is not None:
            lse = native_logprobs.forward(lib, logits[None], None)[1][0]
        else:
            lse = torch.empty(logits.shape[0], dtype=acc, device=logits.device)
            for at in range(0, logits.shape[0], chunk_size):
                lse[at : at + chunk_size] = torch.logsumexp(logits[at : at + chunk_size].to(acc), dim=-1)
        ctx.save_for_backward(logits, rows, tokens, lse)
        ctx.lib, ctx.chunk_size = lib, chunk_size
        return logits[rows, tokens].to(acc) - lse[rows]

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        logits, rows, tokens, lse = ctx.saved_tensors
        if ctx.lib is not None:
            return native_logprobs.row_backward(ctx.lib, logits, lse, rows, tokens, grad_out), None, None, None, None
        g = grad_out.to(lse.dtype)
        total = torch.zeros_like(lse).index_add_(0, rows, g)       # Σ g of each row's tokens
        order = torch.argsort(rows, stable=True)
        bounds = torch.searchsorted(rows[order], torch.arange(0, logits.shape[0] + ctx.chunk_size, ctx.chunk_size,
                                                              device=rows.device)).tolist()
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for i, at in enumerate(range(0, logits.shape[0], ctx.chunk_size)):
            block = logits[at : at + ctx.chunk_size].to(lse.dtype) - lse[at : at + ctx.chunk_size, None]
            block.exp_().mul_(-total[at : at + ctx.chunk_size, None])
            mine = order[bounds[i] : bounds[i + 1]]                # the entries of this chunk's rows
            block.index_put_((rows[mine] - at, tokens[mine]), g[mine], accumulate=True)
            grad[at : at + ctx.chunk_size] = block.to(logits.dtype)
        return grad, None, None, None, None


def row_token_logprobs(logits: Tensor, rows: Tensor, tokens: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """log π(tokens[j]) under the logits of row rows[j], for logits (K, V) and rows, tokens (M,) → (M,).

    Several tokens may be read from one row: a prompt's last column predicts the first token of each of its
    G completions. The same values as `token_logprobs(logits[rows], tokens)`, without its (M, V) copy of the
    rows and its scatter back: the backward writes the logits' whole gradient in one pass (a row no entry
    reads gets 0), each element summed in fp32 and rounded once. CPU logits take the C kernel (departure 3)."""
    if logits.ndim != 2 or rows.shape != tokens.shape or rows.ndim != 1:
        raise ValueError(f"row_token_logprobs: logits {tuple(logits.shape)}, rows {tuple(rows.shape)} and tokens "
                         f"{tuple(tokens.shape)}; expected (K, V), (M,) and (M,)")
    if chunk_size < 1:
        raise ValueError(f"row_token_logprobs: chunk_size must be >= 1, got {chunk_size}")
    rows = rows.long()
    if rows.numel() and (rows.min().item() < 0 or rows.max().item() >= logits.shape[0]):
        raise ValueError(f"row_token_logprobs: rows span [{rows.min().item()}, {rows.max().item()}], expected "
                         f"[0, {logits.shape[0]})")
    _check_logits_tokens("row_token_logprobs", logits[:1].expand(tokens.shape[0], -1), tokens)  # a view: ids, dtype
    return _RowTokenLogprobs.apply(logits, rows, tokens.long(), native_logprobs.usable(logits[None]), chunk_size)


def token_logprobs_naive(logits: Tensor, tokens: Tensor) -> Tensor:
    """Reference: `log_softmax(logits).gather(tokens)`, in the logits' dtype. Shape: (..., V), (...) → (...)."""
    _check_logits_tokens("token_logprobs_naive", logits, tokens)
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Entropy of softmax(logits) at each position: H = logsumexp(z) − Σ_v p_v z_v.

    Shape: (..., V) → (...). Computed in fp32 for fp16/bf16 logits (returned as fp32). Chunking bounds
    the fp32 scratch in a no-grad pass; under autograd each chunk's softmax is kept for backward. Where
    no gradient is asked for, CPU logits take the C kernel (departure 3).
    """
    if logits.ndim < 1 or not logits.is_floating_point():
        raise ValueError(f"entropy_from_logits: expected floating logits (..., V), got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if chunk_size < 1:
        raise ValueError(f"entropy_from_logits: chunk_size must be >= 1, got {chunk_size}")
    acc = _compute_dtype(logits.dtype)
    grid = _as_grid(logits)  # (R, C, V)
    lib = None if torch.is_grad_enabled() and logits.requires_grad else native_logprobs.usable(grid)
    if lib is not None:
        return native_logprobs.forward(lib, grid, None, entropy=True)[2].reshape(logits.shape[:-1])
    out = torch.empty(grid.shape[:2], dtype=acc, device=logits.device)
    for r, c in _blocks(grid.shape[0], grid.shape[1], chunk_size):
        z = grid[r, c].to(acc)
        p = torch.softmax(z, dim=-1)
        out[r, c] = torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
    return out.reshape(logits.shape[:-1])


def _check_seq_inputs(where: str, token_logps: Tensor, mask: Tensor) -> None:
    check_ndim(where, "token_logps", token_logps, 2, "(batch, response_len)")
    check_same_shape(where, "token_logps", token_logps, mask=mask)


def sequence_logprob_sum(token_logps: Tensor, mask: Tensor) -> Tensor:
    """Σ_t mask·log π(y_t): the sequence log-likelihood log π(y|x). Shape: (B, T), (B, T) → (B,)."""
    _check_seq_inputs("sequence_logprob_sum", token_logps, mask)
    return masked_sum(token_logps, mask, dim=-1)


def sequence_logprob_mean(token_logps: Tensor, mask: Tensor) -> Tensor:
    """Σ_t mask·log π(y_t) / |y|: the length-normalized log-likelihood. Shape: (B, T), (B, T) → (B,).

    A row with no masked-in token is an error (its mean is undefined); this check is a device sync.
    """
    _check_seq_inputs("sequence_logprob_mean", token_logps, mask)
    lengths = masked_count(mask, dim=-1)  # (B,)
    empty = (lengths == 0).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"sequence_logprob_mean: rows {empty.tolist()} have no tokens in mask")
    return masked_sum(token_logps, mask, dim=-1) / lengths.to(token_logps.dtype)
