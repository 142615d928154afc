"""Attention for sequences that share a prefix, packed without padding: [prefix | s_1 | … | s_G] per group.

GRPO scores G completions of one prompt; a padded batch runs the prompt G times through every matmul,
and pads every completion to the batch's longest. Packed into one row — each group's prompt once
(its own length, no padding), then its G completions each at its own length, then the next group —
the matmuls run exactly the batch's real tokens, Σ_groups (P_g + Σ_j n_j) instead of B·(P + N). At
512-token completions of a random-init model the mean length is ~250 and a fifth hit the limit: padded
slots ran ~2× the real tokens through the matmuls and ~4× the real attention products (measured:
docs/performance.md). The attention must keep the sequences apart: slot j attends to its group's prompt
and causally to its own tokens, never to another slot or group. A dense mask over the row would do that
through any kernel, but computes and masks every block to keep a few; this kernel computes only the
blocks that are read, each at its real size (up to its bucket's padding, below):

    prefix g   (P_g queries) × prefix g keys (P_g), causal                          — once per group
    slot (g,j) (n_j queries) × [prefix g keys (P_g) | slot (g,j) keys (n_j), causal] — once per sequence

which is exactly the attention each sequence has in its own unpadded row (same keys, same order, the
same scale and fp32 softmax as `transformers`' eager attention), so logits and gradients equal the
padded forward's up to round-off (tests/test_models_prefix_attention.py; the naive reference is the
padded forward itself).

It plugs into `transformers` through its `AttentionInterface`: `shared_prefix(model)` switches the
model's attention to this kernel for one forward, which then takes `segments=` (a `Segments`: where
each prompt and slot lies in the row) as a keyword argument (transformers passes unknown forward kwargs
down to the attention function) and a 4-D boolean `attention_mask` of shape (1, 1, 1, T), all True (a
4-D mask skips transformers' own mask construction). Positions are the caller's: slot tokens continue
from their prompt's length. GQA groups the query heads of one KV head into the rows of one matmul (no
repeat_kv).

A sequence longer than `QUERY_BLOCK` queries is computed as blocks of queries, each block a product of
its own with only the keys it reads — the context and the sequence's keys up to the block's last query —
so the upper triangle of the sequence's own square is skipped block by block instead of computed and
masked away (192 queries in two blocks of 96: 19% fewer query-key pairs; 768 in six of 128: 31%). A
block's later queries read every earlier key, as in the whole product; each query's keys, scores and
softmax are the same as unblocked, so its output is too, and a key read by several blocks gets its
gradient summed from each (the same sum in another order).

Products are computed in buckets: longest first, a product joins the open bucket while the padding that
adds costs less than a bucket's fixed cost (`PAD_BUDGET`), so equal-length pairs (DPO) or a group's
completions that all hit the limit run as one batched call, and a ragged batch costs its real sizes. One
gather per layer copies every bucket's queries, keys and values out of the row (each slot's keys are its
prompt's then its own), one gather puts the outputs back in column order; a bucket's products are padded
to its longest. The gathers move (token, head) rows of head_dim values, so a bucket's queries land as
(M, Hq, L, D) and its keys and values as (M, Hkv, S, D), the layouts the matmuls and SDPA read, with no
copy in between (DPO@64 attention call 0.79–0.92× the time of gathering (H·D) rows and permuting, GRPO@512
0.93×, bit-equal; docs/performance.md). Three ways to compute a bucket, picked by its key length:
- short (fewer than `SDPA_FROM` keys): two matmuls and an fp32 softmax, GQA as the rows of one matmul
  per KV head (as transformers' eager attention); the probabilities (queries × keys) are kept for the
  backward in the values' dtype only (`_Softmax`; eager attention keeps an fp32 copy as well). In bf16 on
  a CPU the softmax and its backward are one C pass each (`native.softmax`), each query's mask given as
  the count of keys it attends (always a prefix of its product's keys);
- long: `F.scaled_dot_product_attention` under a boolean mask (PyTorch's fused flash kernel on a CPU,
  and on CUDA); it keeps one log-sum-exp per query, not the probabilities (at 512-token completions kept
  fp32 probabilities were 1.4 GB on tiny-30m). With `SDPA_FROM` at `CAUSAL_FROM` (the default) no bucket
  takes this way: the matmuls, once their fp32 copy was gone, were faster up to 256 keys at every shape
  measured and even at 528 (docs/performance.md); it is there for a lower `SDPA_FROM`;
- very long (a sequence of `CAUSAL_FROM` keys or more, not blocked): SDPA with `is_causal` and no mask,
  each slot's product run as the square [its prompt | itself] — its prompt's queries computed again and
  their outputs dropped (the prompt's own product gives them) — padded at the end, which a causal product
  never reads. The kernel then skips the key blocks above the diagonal, which the masked form computes and
  throws away, and keeps no probabilities: at 1,024-token DPO pairs the query blocks through the matmuls
  took 0.62 of its time but 2.6× its memory (458 against 173 MiB a call, ten calls a step on tiny-30m), so
  from 768 keys a sequence goes this way. Measured on a CPU only: on a GPU the flash kernel may well be
  the better way from fewer keys (set `SDPA_FROM`, `CAUSAL_FROM`).
All three compute the same attention (tests/test_models_prefix_attention.py: fp32 within round-off). The
buckets and the gather indices are planned once per row (`_plan`, cached) and shared by every layer.
Measured (`python benchmarks/prefix_attention.py`, one attention call forward + backward, bf16,
1 thread): docs/performance.md.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

from posttrain.native import softmax as softmax_kernel

NAME = "posttrain_shared_prefix"
# keys per query at or above which a product goes through SDPA (docs above). benchmarks/prefix_attention.py,
# after `_Softmax`: the matmuls 0.17-0.72 of masked SDPA's time up to 256 keys, 1.06 at 528; the DPO stage at
# 256-token pairs 15% faster a step with this at 512 than at 256. With query blocks the matmuls took 0.48 of
# the causal squares' time at 528 keys and 0.62 at 1,024, but at 1,024 they keep 2.6× the memory
SDPA_FROM = 768
# keys per query from which an SDPA bucket runs as causal squares, a sequence whole (docs above)
CAUSAL_FROM = 768
# padding (query × key elements) worth one more bucket: an estimate of a bucket's fixed cost (about a dozen
# small ops per layer, forward and backward) in padded elements' attention work; 0 and 4,096 measured
# within noise at GRPO and DPO shapes, no bucketing 1.4× slower at 512-token GRPO (docs/performance.md)
PAD_BUDGET = 4096
# queries per product at most: a longer sequence's queries run as blocks, each against only the keys it reads
# (`_plan`). One attention call forward + backward at 128 against whole sequences (benchmarks/prefix_attention.py):
# 0.92× the time and 0.81× the memory at 256-token DPO pairs, 0.54× and 0.59× at 512-token GRPO completions;
# 96 and 128 measured alike at DPO's 192-query replies, 64 slower, 192 and 256 slower at 512 and 1,024 keys
QUERY_BLOCK = 128


class Segments(NamedTuple):
    """Where the groups of a packed row lie: group g's prompt at columns [prefixes[g][0], + prefixes[g][1]),
    its slots at [start, start + length) for each (start, length) in slots[g]. Every column of the row
    belongs to exactly one prompt or slot, in order: prompt 0, its slots, prompt 1, …"""

    prefixes: tuple[tuple[int, int], ...]
    slots: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def width(self) -> int:
        return sum(p for _, p in self.prefixes) + sum(n for group in self.slots for _, n in group)


class _Bucket(NamedTuple):
    """M products computed together, each padded to L queries × S keys."""

    m: int
    length: int
    keys: int
    sdpa: bool    # through fused SDPA (S ≥ `SDPA_FROM`), else two matmuls and a softmax
    mask: Tensor | None  # which keys each (real or padding) query attends, no row empty: SDPA's (M, 1, L, S)
                         # bool, the softmax's (M, 1, 1, L, S) fp32 bias (0 or −inf); None: causal squares
                         # (L = S, from `CAUSAL_FROM` keys)
    limit: Tensor | None = None  # the softmax's mask as counts: every query attends a prefix of its keys,
                                 # [0, limit) (M, L) int32, for the C kernel (`native.softmax`)


class _Plan(NamedTuple):
    """How every layer of one forward computes the products of a `Segments` row (built once per row and
    head count).

    A product: queries [q, q + n) attending to `ctx` context keys [c, c + ctx) then causally to their own
    keys — a prompt (ctx 0) or a slot (ctx: its prompt's length). Products of similar size share a bucket;
    one gather per layer copies every bucket's queries, keys and values out of the row (padding: column 0),
    one gather puts the real queries' outputs back in column order. The gathers take (token, head) rows of
    head_dim values, so each lands in its bucket's batched layout — queries and outputs (M, Hq, L, D), keys
    and values (M, Hkv, S, D) — with no copy between the gather and the matmuls."""

    buckets: tuple[_Bucket, ...]
    q_index: Tensor    # (Σ M·Hq·L,) the (query column · Hq + head) row of each bucket query, (m, head, i) order
    k_index: Tensor    # (Σ M·Hkv·S,) the (key column · Hkv + head) row of each bucket key, (m, head, s) order
    out_index: Tensor  # (T·Hq,) for each (column, head) of the row, its output's row in the buckets' outputs
    out_reader: Tensor  # (Σ M·Hq·L,) for each bucket row, the (column, head) row its output goes to; T·Hq: none


def _blocks(n: int, block: int) -> list[tuple[int, int]]:
    """A sequence's n queries as (first, count) blocks of at most `block`, as equal as whole queries allow."""
    parts = max(1, -(-n // block))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(a, b - a) for a, b in itertools.pairwise(bounds)]


@functools.lru_cache(maxsize=4)
def _plan(segments: Segments, sdpa_from: int, causal_from: int, pad_budget: int, device: torch.device,
          query_block: int = 10**9, heads: tuple[int, int] = (1, 1)) -> _Plan:
    # A product (q, n, c, ctx, o, m): a sequence's own columns [q, q + n) after `ctx` context keys [c, c + ctx)
    # (its prompt's; none for a prompt), its queries o … o + m − 1 of them, which attend the context and own
    # keys [0, o + m) causally — o + m + ctx keys, the query at o + i the first ctx + o + i + 1 of them. A
    # sequence longer than `query_block` runs as blocks of queries, each with only the keys it reads: the own
    # square's upper triangle computed blockwise instead of whole (at 192 queries in two blocks, 19% fewer
    # query-key pairs; the later blocks read every earlier key, as a causal sequence does) — unless it is long enough
    # for the causal squares (`causal_from` keys), which skip the triangle themselves
    causal_from = max(sdpa_from, causal_from)
    seqs = [(a, p, a, 0) for a, p in segments.prefixes]
    seqs += [(q, n, a, p) for (a, p), slots in zip(segments.prefixes, segments.slots) for q, n in slots]
    products = [(q, n, c, ctx, o, m) for q, n, c, ctx in seqs
                for o, m in (_blocks(n, query_block) if ctx + n < causal_from else [(0, n)])]
    # longest first, then greedily: a product joins the open bucket when the padding that adds costs less
    # than a bucket's fixed cost (`pad_budget` query × key elements), else it opens the next bucket
    products.sort(key=lambda x: (-x[5], -(x[3] + x[4])))
    groups: list[tuple[list[tuple[int, int, int, int, int, int]], int]] = []  # (its products, its keys S)
    for x in products:
        m, keys_x = x[5], x[3] + x[4] + x[5]
        if groups:
            members, keys = groups[-1]
            length, grown = members[0][5], max(keys, keys_x)
            if (len(members) + 1) * length * grown - len(members) * length * keys - m * keys_x <= pad_budget:
                members.append(x)
                groups[-1] = (members, grown)
                continue
        groups.append(([x], keys_x))
    buckets, q_index, k_index, cols, rows = [], [], [], [], []
    at = 0  # the first bucket row of the next product
    for members, keys in groups:
        k = torch.arange(keys)
        if keys >= causal_from:  # squares [context | own keys read], padded at the end; only the queries' rows kept
            for q, n, c, ctx, o, m in members:
                square = torch.where(k < ctx, c + k, torch.where(k - ctx < o + m, q + k - ctx, 0))
                q_index.append(square)
                k_index.append(square)
                cols.append(q + o + torch.arange(m))
                rows.append(at + ctx + o + torch.arange(m))
                at += keys
            buckets.append(_Bucket(len(members), keys, keys, True, None))
            continue
        length = members[0][5]
        i = torch.arange(length)
        for q, n, c, ctx, o, m in members:
            q_index.append(torch.where(i < m, q + o + i, 0))
            k_index.append(torch.where(k < ctx, c + k, torch.where(k - ctx < o + m, q + k - ctx, 0)))
            cols.append(q + o + torch.arange(m))
            rows.append(at + torch.arange(m))
            at += length
        # a padding query (i ≥ m) attends all the product's keys, so that no row is empty
        allowed = torch.stack([(k[None] < ctx) | ((k[None] - ctx <= o + i[:, None]) & (k[None] - ctx < o + m))
                               for _, _, _, ctx, o, m in members])[:, None]
        if keys >= sdpa_from:
            buckets.append(_Bucket(len(members), length, keys, True, allowed.to(device)))
            continue
        bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[:, :, None]
        limit = allowed[:, 0].sum(-1, dtype=torch.int32)  # a prefix: (k < ctx) | (k − ctx ≤ min(o + i, o + m − 1))
        buckets.append(_Bucket(len(members), length, keys, False, bias.to(device), limit.to(device)))
    out_index = torch.empty(segments.width, dtype=torch.long)
    out_index[torch.cat(cols)] = torch.cat(rows)
    # (column, head) rows: bucket b's M·L query columns as (m, head, i) rows, its keys as (m, head, s), and each
    # output row r (of Σ M·L) with head h at (m, h, i) of its bucket, r = its first row + m·L + i
    hq, hkv = heads
    q_cols, k_cols = torch.cat(q_index), torch.cat(k_index)
    q_rows, k_rows, first = [], [], torch.empty(at, dtype=torch.long)
    q_at = k_at = flat = 0
    for b in buckets:
        qb = q_cols[q_at : q_at + b.m * b.length].view(b.m, 1, b.length)
        kb = k_cols[k_at : k_at + b.m * b.keys].view(b.m, 1, b.keys)
        q_rows.append((qb * hq + torch.arange(hq).view(1, hq, 1)).reshape(-1))
        k_rows.append((kb * hkv + torch.arange(hkv).view(1, hkv, 1)).reshape(-1))
        r = torch.arange(b.m * b.length)
        first[q_at : q_at + b.m * b.length] = flat + (r // b.length) * hq * b.length + r % b.length
        q_at, k_at, flat = q_at + b.m * b.length, k_at + b.m * b.keys, flat + b.m * hq * b.length
    lengths = torch.tensor([b.length for b in buckets]).repeat_interleave(torch.tensor([b.m * b.length for b in buckets]))
    out_rows = first[out_index][:, None] + torch.arange(hq)[None] * lengths[out_index][:, None]  # (T, Hq)
    q_rows, out_rows = torch.cat(q_rows), out_rows.reshape(-1)
    kept = torch.zeros(q_rows.numel(), dtype=torch.bool)
    kept[out_rows] = True
    out_reader = torch.where(kept, q_rows, out_rows.numel())  # a kept output's row is its own query's (column, head)
    return _Plan(tuple(buckets), q_rows.to(device), torch.cat(k_rows).to(device), out_rows.to(device),
                 out_reader.to(device))


class _Gather(torch.autograd.Function):
    """rows.index_select(0, index), whose backward is a gather as well: each source row j takes the gradient of
    one output row, `reader[j]` (the output's row count: none, a zero row). Exact where every other output
    row that reads j has a zero gradient: the queries gathered for padding rows, or for a causal square's
    prompt part, whose outputs are dropped. `index_add_` sums such rows in at 3-6x the time of the gather."""

    @staticmethod
    def forward(ctx, rows: Tensor, index: Tensor, reader: Tensor, zero_row: bool) -> Tensor:
        ctx.save_for_backward(reader)
        ctx.zero_row = zero_row
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        (reader,) = ctx.saved_tensors
        if ctx.zero_row:
            grad = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])
        return grad.index_select(0, reader), None, None, None


class _Softmax(torch.autograd.Function):
    """probs = softmax(scores · scaling + bias) in fp32, returned in `dtype` and kept only in it for the backward.

    Eager attention under autocast keeps the fp32 probabilities (the softmax's saved output) and their
    `dtype` copy (the value product's): three bytes in every five are the fp32 copy. The backward here takes
    the softmax gradient from the `dtype` probabilities the value product holds anyway, and writes it in
    that dtype: in fp32 the same probabilities and the same gradient; in bf16 the probabilities rounded as
    the value product already reads them. The scores' gradient is rounded to their dtype either way.

    bf16 scores on a CPU go through the C kernel (`native.softmax`: one pass each way, the mask as
    per-query key counts `limit`), else through PyTorch ops — `aten._softmax_backward_data` accumulates
    in fp32 — with no fp32 temporary of the (…, L, S) size in the backward and in-place ones in the
    forward. The two agree within one bf16 rounding (tests/test_native_softmax.py)."""

    @staticmethod
    def forward(ctx, scores: Tensor, bias: Tensor, limit: Tensor | None, scaling: float, dtype: torch.dtype) -> Tensor:
        m, hkv, group, length, keys = scores.shape
        lib = softmax_kernel.usable(scores.view(m, hkv * group, length, keys), limit) if dtype == torch.bfloat16 else None
        ctx.scaling, ctx.scores_dtype, ctx.lib = scaling, scores.dtype, lib
        if lib is not None:
            probs = softmax_kernel.forward(lib, scores.view(m, hkv * group, length, keys), limit, scaling)
            ctx.save_for_backward(probs, limit)
            return probs.view(scores.shape)
        x = scores.float()
        x = x.mul_(scaling) if x is not scores else x * scaling  # never write into the caller's scores
        probs = torch.softmax(x.add_(bias), dim=-1).to(dtype)
        ctx.save_for_backward(probs, None)
        return probs

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        probs, limit = ctx.saved_tensors
        if ctx.lib is not None:
            g = softmax_kernel.backward(ctx.lib, probs, grad.reshape(probs.shape), limit, ctx.scaling)
            return g.view(grad.shape), None, None, None, None
        g = torch.ops.aten._softmax_backward_data(grad.to(probs.dtype), probs, -1, probs.dtype)
        return g.mul_(ctx.scaling).to(ctx.scores_dtype), None, None, None, None


def _matmul_bucket(bucket: _Bucket, q: Tensor, k: Tensor, v: Tensor, scaling: float, dropout: float) -> Tensor:
    """A bucket of short products: two matmuls and an fp32 softmax (as transformers' eager attention), its
    probabilities kept in the values' dtype (`_Softmax`), GQA as the rows of one matmul per KV head.
    Shapes: q (M, Hq, L, D); k, v (M, Hkv, S, D), contiguous → (M·Hq·L, D)."""
    m, hq, length, d = q.shape
    hkv, keys = k.shape[1], bucket.keys
    group = hq // hkv
    scores = torch.matmul(q.view(m, hkv, group * length, d), k.transpose(-1, -2)).view(m, hkv, group, length, keys)
    probs = _Softmax.apply(scores, bucket.mask, bucket.limit, scaling, v.dtype)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs.view(m, hkv, group * length, keys), v).view(-1, d)       # (M, Hkv, g·L, D) rows


def _sdpa_bucket(bucket: _Bucket, q: Tensor, k: Tensor, v: Tensor, scaling: float, dropout: float) -> Tensor:
    """A bucket of long products through fused SDPA (GQA without repeated keys). Shapes as `_matmul_bucket`'s."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bucket.mask, scale=scaling, dropout_p=dropout,
                                         is_causal=bucket.mask is None, enable_gqa=True)  # (M, Hq, L, D)
    return out.reshape(-1, q.shape[-1])


def shared_prefix_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                            scaling: float, dropout: float = 0.0, *, segments: Segments, **kwargs) -> tuple[Tensor, None]:
    """The attention function (transformers' signature). Shapes: query (1, Hq, T, D); key, value
    (1, Hkv, T, D) with T = segments.width. Returns (1, T, Hq, D) and no weights."""
    rows, _, width, _ = query.shape
    if rows != 1 or width != segments.width:
        raise ValueError(f"shared_prefix_attention: expected one packed row of {segments.width} columns "
                         f"(the segments' width), got {rows} × {width}")
    hq, hkv, d = query.shape[1], key.shape[1], query.shape[-1]
    plan = _plan(segments, SDPA_FROM, CAUSAL_FROM, PAD_BUDGET, query.device, QUERY_BLOCK, (hq, hkv))
    drop = dropout if module.training else 0.0
    # token-major (T·H, D) rows: the projections' own layout, of which transformers' (1, H, T, D) is a transposed
    # view (a copy only where it is not). Each gather copies (token, head) rows straight into the buckets'
    # layouts, its backward adds them back (`index_select`/`index_add_`). `squeeze`, not `[0]`: a view both
    # ways, where select's backward writes its gradient into a zero-filled copy
    q_rows, k_rows, v_rows = (t.squeeze(0).transpose(0, 1).reshape(-1, d) for t in (query, key, value))
    # a query row's gradient is its real product's alone (a padding row's, or a square's prompt part, is zero)
    qs = _Gather.apply(q_rows, plan.q_index, plan.out_index, False).split([b.m * hq * b.length for b in plan.buckets])
    ks, vs = (t.index_select(0, plan.k_index).split([b.m * hkv * b.keys for b in plan.buckets]) for t in (k_rows, v_rows))
    outs = [(_sdpa_bucket if b.sdpa else _matmul_bucket)(b, q.view(b.m, hq, b.length, d), k.view(b.m, hkv, b.keys, d),
                                                         v.view(b.m, hkv, b.keys, d), scaling, drop)
            for b, q, k, v in zip(plan.buckets, qs, ks, vs)]
    out = torch.cat(outs) if len(outs) > 1 else outs[0]                                   # (Σ M·Hq·L, D)
    return _Gather.apply(out, plan.out_index, plan.out_reader, True).view(1, width, hq, d), None


AttentionInterface.register(NAME, shared_prefix_attention)


@contextmanager
def shared_prefix(model: nn.Module) -> Iterator[None]:
    """Run `model`'s attention through `shared_prefix_attention` inside the block (its forward must then
    get `segments=` and a (1, 1, 1, T) mask). Autograd's backward needs no switch."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
