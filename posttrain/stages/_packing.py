"""Sequence log-probs of prompt + reply sequences without padding, and with a shared prompt per pair or group.

The DPO family needs log π(reply | prompt) of two replies to the same prompt. The naive forward
(`sequence_logps_padded`) pads 2B sequences to the longest and runs the prompt twice. Two savings,
each exact up to float rounding (tests/test_pref_packing.py checks both against the naive one):

1. Packing (`sequence_logps`): sequences are laid end to end in rows (first-fit decreasing, rows of
   ≤ `row_len` tokens); position ids restart at 0 for each sequence, which is how transformers 5
   selects its block-diagonal packed-sequence mask (attention_mask=None, no cache). No padding.
2. Shared prompt (`pair_logps`): each pair is laid out [prompt | reply a | reply b] with an explicit
   4-D mask — reply b attends to the prompt and to itself, never to reply a — and reply b's positions
   continue from the prompt, so every token sees exactly the context it has in its own sequence. The
   first token of reply b is predicted from the prompt's last position, not from its left neighbour.
   A pair costs P + A + B tokens instead of 2P + A + B (the prompt is ~40% of a world pair).

3. Shared prompt per GRPO group (`shared_prompt_logits`): a group of G completions of one prompt is one
   row [prompt | c_1 | … | c_G] with the completions in slots of equal width, run through
   `models.prefix_attention` (each slot attends to the prompt and to itself; only those blocks are
   computed). A group costs P + G·(N − 1) tokens instead of G·(P + N) (the last completion column
   predicts nothing and only it would attend to itself, so it is no input).

Cost notes: in 1 and 2 attention is dense within a row (≤ row_len² per head), a small price next to the
matmuls saved at these lengths; the 4-D boolean mask is (R, 1, W, W). With G slots that price grows as
G² (measured: no net gain at G = 8), hence the block kernel of 3 — which 2 also takes for pairs longer
than a row (`pair_logps_blocks`: a pair is a group of two; measured, tiny-30m bf16 forward + backward of
8 pairs of 64 + 192 + 192 tokens, 1 thread: 5.39 s against 6.76 for the dense mask through SDPA and 6.83
for the 16 padded sequences; docs/performance.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from posttrain.data import EncodedCompletion, collate_sft
from posttrain.losses import sequence_logprob_mean, sequence_logprob_sum, token_logprobs
from posttrain.models.prefix_attention import shared_prefix
from posttrain.rollout.text import positions_from_mask


def sequence_logps_padded(model, seqs: list[EncodedCompletion], pad_id: int, *, length_normalized: bool) -> Tensor:
    """The naive reference: one right-padded (B, T) forward. log π(reply | prompt), summed or
    length-normalized over reply tokens. Shape: (B,)."""
    b = collate_sft(seqs, pad_id)  # (B, T)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]  # (B, T-1, V)
    targets = b.labels[:, 1:]
    mask = targets != -100
    logps = token_logprobs(logits, targets.clamp_min(0))  # (B, T-1)
    return sequence_logprob_mean(logps, mask) if length_normalized else sequence_logprob_sum(logps, mask)


def _require_completion(n: int) -> None:
    if n == 0:  # `logits_to_keep=0` would mean "all positions"
        raise ValueError("completion logits: the batch has no completion tokens")


def padded_completion_logits(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, n: int) -> Tensor:
    """Logits predicting the last `n` tokens of a padded (B, T) batch — left-padded prompt, right-padded
    completion of n columns. The last column is no input: it predicts nothing and nothing attends to
    it. Shape: (B, n, V)."""
    _require_completion(n)
    return model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                 position_ids=position_ids[:, :-1], logits_to_keep=n).logits


def first_fit(lengths: list[int], cap: int) -> list[list[int]]:
    """Indices grouped into rows of total length ≤ cap, longest first (first-fit decreasing)."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        r = next((r for r in range(len(rows)) if fill[r] + lengths[i] <= cap), None)
        if r is None:
            rows.append([])
            fill.append(0)
            r = len(rows) - 1
        rows[r].append(i)
        fill[r] += lengths[i]
    return rows


def _reduce(logps: Tensor, keep: Tensor, segment: Tensor, n: int, length_normalized: bool) -> Tensor:
    """Σ (or mean) of the kept token log-probs per segment id. Shapes: (R, W) each → (n,)."""
    seg = segment[keep]
    sums = torch.zeros(n, dtype=logps.dtype, device=logps.device).index_add(0, seg, logps[keep])
    if not length_normalized:
        return sums
    counts = torch.zeros(n, dtype=logps.dtype, device=logps.device).index_add(0, seg, torch.ones_like(logps[keep]))
    return sums / counts


def sequence_logps(model, seqs: list[EncodedCompletion], pad_id: int, *, length_normalized: bool,
                   row_len: int = 160) -> Tensor:
    """`sequence_logps_padded` with the sequences packed into rows. Shape: (B,).

    A row's padding tail gets positions 0, 1, … (a sequence of its own, attended by no real token);
    every sequence starts with prompt tokens (label -100), so nothing is predicted across a boundary."""
    lengths = [len(s.input_ids) for s in seqs]
    rows = first_fit(lengths, max(row_len, max(lengths)))
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    segment = torch.full((len(rows), width), -1, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = lengths[i]
            ids[r, at : at + n] = torch.tensor(seqs[i].input_ids)
            labels[r, at : at + n] = torch.tensor(seqs[i].labels)
            segment[r, at : at + n] = i
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(width - at)
    device = next(model.parameters()).device
    ids, labels, segment, positions = ids.to(device), labels.to(device), segment.to(device), positions.to(device)
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, :-1]  # (R, W-1, V)
    targets = labels[:, 1:]
    keep = targets != -100
    logps = token_logprobs(logits, targets.clamp_min(0))  # (R, W-1)
    return _reduce(logps, keep, segment[:, 1:], len(seqs), length_normalized)


class PackedPairs(NamedTuple):
    """Pairs laid out [prompt | a | b] in rows. Shapes: (R, W) unless noted."""

    input_ids: Tensor
    position_ids: Tensor
    attention: Tensor  # (R, 1, W, W) bool: True where query q may attend key k
    targets: Tensor  # the token each position's label asks for (-100: none)
    source: Tensor  # the position whose logits predict it
    segment: Tensor  # 2·pair + (0 for a, 1 for b); -1 elsewhere


def pack_pairs(pairs: list[tuple[EncodedCompletion, EncodedCompletion]], pad_id: int, row_len: int) -> PackedPairs:
    """Lay each (a, b) pair — two encodings of one prompt — out as [prompt | a's reply | b's reply]."""
    spans = []
    for k, (a, b) in enumerate(pairs):
        p = a.prompt_len
        if b.prompt_len != p or a.input_ids[:p] != b.input_ids[:p]:
            raise ValueError(f"pack_pairs: pair {k} ({a.origin or 'no origin'}) does not share its prompt tokens")
        spans.append((p, len(a.input_ids) - p, len(b.input_ids) - p))
    lengths = [p + na + nb for p, na, nb in spans]
    rows = first_fit(lengths, max(row_len, max(lengths)))
    width = max(sum(lengths[i] for i in row) for row in rows)
    shape = (len(rows), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    targets = torch.full(shape, -100, dtype=torch.long)
    source = torch.zeros(shape, dtype=torch.long)
    segment = torch.full(shape, -1, dtype=torch.long)
    group = torch.full(shape, -1, dtype=torch.long)  # which pair a token belongs to (-1: padding)
    is_b = torch.zeros(shape, dtype=torch.bool)
    is_a = torch.zeros(shape, dtype=torch.bool)
    for r, members in enumerate(rows):
        at = 0
        for k in members:
            a, b = pairs[k]
            p, na, nb = spans[k]
            a_at, b_at = at + p, at + p + na
            ids[r, at:b_at] = torch.tensor(a.input_ids)
            ids[r, b_at : b_at + nb] = torch.tensor(b.input_ids[p:])
            positions[r, at:b_at] = torch.arange(p + na)
            positions[r, b_at : b_at + nb] = torch.arange(p, p + nb)
            targets[r, a_at:b_at] = torch.tensor(a.labels[p:])
            targets[r, b_at : b_at + nb] = torch.tensor(b.labels[p:])
            source[r, at : at + p + na + nb] = torch.arange(at - 1, at + p + na + nb - 1)
            source[r, b_at] = a_at - 1  # b's first token is predicted from the prompt's last position
            segment[r, a_at:b_at] = 2 * k
            segment[r, b_at : b_at + nb] = 2 * k + 1
            group[r, at : b_at + nb] = k
            is_a[r, a_at:b_at] = True
            is_b[r, b_at : b_at + nb] = True
            at += p + na + nb
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # (W, W) k ≤ q
    same = group[:, :, None] == group[:, None, :]  # (R, W, W)
    b_sees_a = is_b[:, :, None] & is_a[:, None, :]
    real = group >= 0
    attention = causal & same & ~b_sees_a & real[:, :, None]
    attention |= torch.eye(width, dtype=torch.bool) & ~real[:, :, None]  # padding attends to itself (no empty row)
    return PackedPairs(ids, positions, attention[:, None], targets, source.clamp_min(0), segment)


def custom_mask(model, allowed: Tensor) -> Tensor:
    """A 4-D mask (True = may attend) in the form the model's attention kernels read: transformers 5
    passes a 4-D mask through unchanged, SDPA reads booleans, eager attention *adds* the mask to the
    scores, so it gets 0 / the dtype's minimum instead (a boolean would add 1 or 0)."""
    if getattr(model.config, "_attn_implementation", "sdpa") != "eager":
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(torch.float32).min)


def pair_logps(model, pairs: list[tuple[EncodedCompletion, EncodedCompletion]], pad_id: int, *,
               length_normalized: bool, row_len: int = 192) -> tuple[Tensor, Tensor]:
    """log π of both replies of each pair, from one shared-prompt forward. Shapes: (B,), (B,).

    Pairs that fit several to a row (short pairs, ≤ `row_len` tokens) are packed under a dense mask
    (`pack_pairs`); when every pair is longer — each would be alone in its row anyway — the pairs go
    through the shared-prefix kernel instead (`pair_logps_blocks`), which computes only the attention
    blocks each reply reads and holds no W × W mask."""
    if min(len(a.input_ids) + len(b.input_ids) - a.prompt_len for a, b in pairs) > row_len:
        return pair_logps_blocks(model, pairs, pad_id, length_normalized=length_normalized)
    device = next(model.parameters()).device
    pk = PackedPairs(*(t.to(device) for t in pack_pairs(pairs, pad_id, row_len)))
    logits = model(input_ids=pk.input_ids, position_ids=pk.position_ids, attention_mask=custom_mask(model, pk.attention),
                   use_cache=False).logits  # (R, W, V)
    keep = pk.targets != -100
    rows = torch.arange(logits.shape[0], device=device)[:, None].expand_as(pk.source)
    picked = logits[rows, pk.source]  # (R, W, V): the logits that predict each position
    logps = token_logprobs(picked, pk.targets.clamp_min(0))  # (R, W)
    both = _reduce(logps, keep, pk.segment, 2 * len(pairs), length_normalized)  # (2B,) a0, b0, a1, b1, …
    return both[0::2], both[1::2]


def pair_logps_blocks(model, pairs: list[tuple[EncodedCompletion, EncodedCompletion]], pad_id: int, *,
                      length_normalized: bool) -> tuple[Tensor, Tensor]:
    """`pair_logps` as a group of two: each pair's replies are the two slots of one [prompt | a | b] row
    of `shared_prompt_logits` (prompts left-padded to the longest, replies right-padded), consecutive
    pairs with the same prompt sharing one row. Shapes: (B,), (B,)."""
    device = next(model.parameters()).device
    p = max(a.prompt_len for a, _ in pairs)
    n = max(len(x.input_ids) - x.prompt_len for pair in pairs for x in pair)
    shape = (2 * len(pairs), p + n)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    real = torch.zeros(shape, dtype=torch.bool)
    targets = torch.full((shape[0], n), -100, dtype=torch.long)   # (2B, N): reply token t's label
    for k, (a, b) in enumerate(pairs):
        if b.prompt_len != a.prompt_len or a.input_ids[: a.prompt_len] != b.input_ids[: b.prompt_len]:
            raise ValueError(f"pair_logps: pair {k} ({a.origin or 'no origin'}) does not share its prompt tokens")
        for j, x in enumerate((a, b)):
            r, q, m = 2 * k + j, x.prompt_len, len(x.input_ids) - x.prompt_len
            ids[r, p - q : p + m] = torch.tensor(x.input_ids)
            real[r, p - q : p + m] = True
            targets[r, :m] = torch.tensor(x.labels[q:])
    ids, real, targets = ids.to(device), real.to(device), targets.to(device)
    logits = shared_prompt_logits(model, ids, real, positions_from_mask(real), p, pad_id)  # (2B, N, V)
    keep = targets != -100
    logps = token_logprobs(logits, targets.clamp_min(0))  # (2B, N)
    segment = torch.arange(shape[0], device=device)[:, None].expand_as(targets)
    both = _reduce(logps, keep, segment, shape[0], length_normalized)  # (2B,) a0, b0, a1, b1, …
    return both[0::2], both[1::2]


# ---- GRPO groups: one prompt, G completions -----------------------------------------------------------
class GroupRows(NamedTuple):
    """Groups laid out for `shared_prefix_attention`: one row per group, the prompt once (P columns,
    left-padded), then `slots` slots of N columns (the completions, right-padded). Shapes: (R, P + slots·N)
    unless noted."""

    input_ids: Tensor
    position_ids: Tensor
    key_mask: Tensor   # (R, 1, 1, P + slots·N) bool: a real token
    row: Tensor        # (B,) the packed row of sequence b
    slot: Tensor       # (B,) its slot in that row
    prefix_len: int
    slots: int


def group_rows(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int, pad_id: int) -> GroupRows:
    """Consecutive sequences with the same prompt share one copy of it. Input: the padded batch
    (B, P + N) — left-padded prompt, right-padded completion, positions as the rollout used them — so
    every completion keeps its positions (continuing from its prompt) and its context. A group smaller
    than the largest leaves empty slots (all padding: computed, never read)."""
    p = prompt_len
    prompts, p_mask = input_ids[:, :p], attention_mask[:, :p]
    same = (prompts[1:] == prompts[:-1]).all(1) & (p_mask[1:] == p_mask[:-1]).all(1)   # (B - 1,)
    starts = [0] + (same.logical_not().nonzero()[:, 0] + 1).tolist()
    sizes = [b - a for a, b in zip(starts, starts[1:] + [len(input_ids)])]
    g, n, rows = max(sizes), input_ids.shape[1] - p, len(starts)
    width = p + g * n
    ids = torch.full((rows, width), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    positions = torch.ones((rows, width), dtype=position_ids.dtype, device=input_ids.device)
    real = torch.zeros((rows, width), dtype=torch.bool, device=input_ids.device)
    for r, (a, size) in enumerate(zip(starts, sizes)):
        for dst, src in ((ids, input_ids), (positions, position_ids), (real, attention_mask)):
            dst[r, :p] = src[a, :p]
            dst[r, p : p + size * n] = src[a : a + size, p:].reshape(-1)
    row = torch.repeat_interleave(torch.arange(rows), torch.tensor(sizes))
    slot = torch.cat([torch.arange(size) for size in sizes])
    return GroupRows(ids, positions, real[:, None, None], row.to(input_ids.device), slot.to(input_ids.device), p, g)


def slot_width(n: int) -> int:
    """Columns per slot for completions of n columns: the last is no input (it predicts nothing), but a
    slot keeps at least one."""
    return max(n - 1, 1)


def shared_prompt_logits(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int,
                         pad_id: int) -> Tensor:
    """Logits predicting every completion token of the padded batch (B, P + N), from one forward per group
    (`group_rows`, `shared_prefix_attention`). Shape: (B, N, V); rows past a completion's end are filler.

    The last completion column is not an input: it predicts nothing and only it would attend to itself,
    so each slot holds N − 1 tokens (exact; 1/N fewer slot tokens through every matmul)."""
    n = input_ids.shape[1] - prompt_len
    _require_completion(n)
    w = slot_width(n)
    cut = slice(None, prompt_len + w)
    lay = group_rows(input_ids[:, cut], attention_mask[:, cut], position_ids[:, cut], prompt_len, pad_id)
    with shared_prefix(model):
        logits = model(input_ids=lay.input_ids, position_ids=lay.position_ids, attention_mask=lay.key_mask,
                       prefix_len=lay.prefix_len, slots=lay.slots, logits_to_keep=lay.slots * w + 1,
                       use_cache=False).logits  # (R, slots·w + 1, V): columns P − 1 … W − 1
    # completion token t of slot j is predicted by column P − 1 (t = 0) or P + j·w + t − 1: kept index j·w + t
    t = torch.arange(n, device=logits.device)
    col = torch.where(t == 0, 0, lay.slot[:, None] * w + t)                               # (B, N)
    return logits[lay.row[:, None], col]
