"""Sequence log-probs of prompt + reply sequences without padding, and with a shared prompt per pair or group.

The DPO family needs log π(reply | prompt) of two replies to the same prompt. The naive forward
(`sequence_logps_padded`) pads 2B sequences to the longest and runs the prompt twice. Two savings,
each exact up to float rounding (tests/test_pref_packing.py checks both against the naive one):

1. Packing (`sequence_logps`): sequences are laid end to end in rows (first-fit decreasing, rows of
   ≤ `row_len` tokens); position ids restart at 0 for each sequence, which is how transformers 5
   selects its block-diagonal packed-sequence mask (attention_mask=None, no cache). No padding.
2. Shared prompt (`shared_prompt_logprobs`): the replies to one prompt — a DPO pair's two (`pair_logps`),
   a GRPO group's G completions — are [prompt | r_1 | … | r_G], every reply at its own length and every
   group packed into one row without padding, run through `models.prefix_attention` (each reply attends
   to its prompt and causally to itself, never to another reply; its positions continue from the
   prompt, so every token sees exactly the context it has in its own sequence; only the blocks read are
   computed). A group costs P + Σ_j (n_j − 1) tokens instead of G·(P + N) (a reply's last token predicts
   nothing and only it would attend to itself, so it is no input; its first is predicted from the
   prompt's last position). Logits are computed only where they predict a reply token.

Cost notes: in 1 attention is dense within a row (≤ row_len² per head), a small price next to the
matmuls saved at SFT lengths. Measured against the dense-mask pair layout this replaced (tiny-30m, bf16
autocast, forward + backward of 8 pairs, 1 thread, the two interleaved in one process): 15 + 47 + 47
tokens 1.24 s against 1.84; docs/performance.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from posttrain.data import EncodedCompletion, collate_sft
from posttrain.losses import (
    entropy_from_logits,
    row_token_logprobs,
    sequence_logprob_mean,
    sequence_logprob_sum,
    token_logprobs,
)
from posttrain.models.kept_columns import kept_columns
from posttrain.models.prefix_attention import Segments, shared_prefix
from posttrain.rollout.text import positions_from_mask


def sequence_logps_padded(model, seqs: list[EncodedCompletion], pad_id: int, *, length_normalized: bool) -> Tensor:
    """The naive reference: one right-padded (B, T) forward. log π(reply | prompt), summed or
    length-normalized over reply tokens. Shape: (B,)."""
    b = collate_sft(seqs, pad_id)  # (B, T)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).logits[:, :-1]  # (B, T-1, V)
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
                 position_ids=position_ids[:, :-1], logits_to_keep=n, use_cache=False).logits


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
    every sequence starts with prompt tokens (label -100), so nothing is predicted across a boundary.
    The rows' width is a multiple of `token_bucket`."""
    lengths = [len(s.input_ids) for s in seqs]
    rows = first_fit(lengths, max(row_len, max(lengths)))
    bucket = token_bucket(next(model.parameters()).device)
    width = -(-max(sum(lengths[i] for i in row) for row in rows) // bucket) * bucket
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


def pair_logps(model, pairs: list[tuple[EncodedCompletion, EncodedCompletion]], pad_id: int, *,
               length_normalized: bool) -> tuple[Tensor, Tensor]:
    """log π of both replies of each pair, from one shared-prompt forward. Shapes: (B,), (B,).

    A pair is a group of two: its prompt once and its two replies, each at its own length, every pair in
    `pack_groups`' one row without padding (`shared_prompt_logprobs`; consecutive pairs with the same
    prompt share it), through the shared-prefix kernel, which computes only the attention blocks each
    reply reads."""
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
    logps = shared_prompt_logprobs(model, ids, real, positions_from_mask(real), p)  # (2B, N): the reply tokens
    keep = targets != -100  # a label is its token or -100 (not in the loss)
    segment = torch.arange(shape[0], device=device)[:, None].expand_as(targets)
    both = _reduce(logps, keep, segment, shape[0], length_normalized)  # (2B,) a0, b0, a1, b1, …
    return both[0::2], both[1::2]


# ---- GRPO groups: one prompt, G completions -----------------------------------------------------------
TOKEN_BUCKET = 32
"""Where the training matmuls are bf16 on a CPU (`token_bucket`), `shared_prompt_logprobs` pads its packed
row's columns, and the columns whose logits it reads, up to a multiple of this, and `sft_batch_loss` its
batch's length up to a multiple of `SFT_BUCKET`. A CPU's bf16 matmuls run on oneDNN, which builds
(JIT-compiles) a kernel for each new shape and keeps ~1,024: a packed row's length changes every step, so
unpadded every step's ~30 distinct linear-layer shapes were new, and on the AMX Xeon building them took
~1.8 ms each (a [M, 512] × [512, 1,408] bf16 product 2.5–2.9 ms the first time, 0.7–1.0 after; fp32 runs on
MKL, which builds nothing: the same time both ways). Forward + backward of tiny-30m on a new length every step
took 0.564 s against 0.495 at one fixed, longer length (/tmp script); the GRPO benchmark's update at 32 tokens
0.395 / 0.413 s against 0.475 / 0.506 unpadded (docs/performance.md "One kernel per shape"). 32 costs ≤ 31
columns of padding (~3% of that benchmark's ~480)."""
SFT_BUCKET = 8  # a (B, T) batch: T to a multiple of 8, so B·T takes few values (≤ 7 padding tokens a row)


def token_bucket(device: torch.device) -> int:
    """`TOKEN_BUCKET` where this forward's matmuls run on oneDNN — a CPU under bf16 autocast — else 1."""
    return TOKEN_BUCKET if device.type == "cpu" and torch.is_autocast_enabled("cpu") \
        and torch.get_autocast_dtype("cpu") == torch.bfloat16 else 1


class PackedGroups(NamedTuple):
    """Groups packed into one row for `shared_prefix_attention`: each group's prompt once, then each of its
    completions at its own length (the inputs that predict its tokens 1 …; token 0 is predicted by the
    prompt's last column). No padding between them; with `bucket` > 1, a last group of padding (no completions:
    attended by nothing, its logits not read) takes T to a multiple of `bucket`, and `keep` repeats its last
    column up to one. T columns; M completion tokens in the batch."""

    input_ids: Tensor     # (1, T)
    position_ids: Tensor  # (1, T) as the rollout used them: a slot continues from its prompt's length
    segments: Segments
    keep: Tensor          # (K,) the columns whose logits are needed: every prompt's last (first), then every slot column
    first: Tensor         # (B',) for each sequence with a completion, the index into `keep` of its prompt's last column
    seq: Tensor           # (M,) the sequence of each completion token, sequence-major
    pos: Tensor           # (M,) its column in the completion
    groups: int           # the prompts (the first `groups` of `keep`); a padding group is not one
    kept: int             # the columns of `keep` that are read (the rest repeat the last, to fill a bucket)


def _group_starts(input_ids: Tensor, attention_mask: Tensor, p: int) -> list[tuple[int, int]]:
    """(first row, size) of each run of consecutive rows with the same prompt (tokens and mask)."""
    prompts, p_mask = input_ids[:, :p], attention_mask[:, :p]
    same = (prompts[1:] == prompts[:-1]).all(1) & (p_mask[1:] == p_mask[:-1]).all(1)   # (B - 1,)
    starts = [0] + (same.logical_not().nonzero()[:, 0] + 1).tolist()
    return [(a, b - a) for a, b in zip(starts, starts[1:] + [len(input_ids)])]


def _completion_lengths(attention_mask: Tensor, p: int) -> Tensor:
    """Real completion tokens per row of a (B, P + N) mask whose completions are right-padded. Shape: (B,)."""
    comp = attention_mask[:, p:]
    lengths = comp.sum(1)
    if not torch.equal(comp, torch.arange(comp.shape[1], device=comp.device)[None] < lengths[:, None]):
        raise ValueError("shared prompt: completions must be right-padded (real tokens first, then padding)")
    return lengths


def packed_width(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> int:
    """Columns of `pack_groups`' row for this batch: every prompt once, every completion less its last token."""
    prompts = sum(int(attention_mask[a, :prompt_len].sum()) for a, _ in _group_starts(input_ids, attention_mask, prompt_len))
    return prompts + int((_completion_lengths(attention_mask, prompt_len) - 1).clamp_min(0).sum())


def pack_groups(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int, *,
                bucket: int = 1) -> PackedGroups:
    """Consecutive sequences with the same prompt share one copy of it. Input: the padded batch (B, P + N) —
    left-padded prompt, right-padded completion, positions as the rollout used them — so every completion
    keeps its positions (continuing from its prompt) and its context. A completion's last token is no
    input (it predicts nothing and nothing attends to it): a slot holds n − 1 columns. `bucket`: the row's
    columns and `keep` padded up to a multiple of it (`TOKEN_BUCKET`)."""
    p = prompt_len
    lengths = _completion_lengths(attention_mask, p).tolist()
    groups = _group_starts(input_ids, attention_mask, p)
    ids, positions, prefixes, slots, slot_cols = [], [], [], [], []
    first, seq, pos = [], [], []
    at = 0  # the next column of the row
    for g, (a, size) in enumerate(groups):
        real = attention_mask[a, :p]
        plen = int(real.sum())
        if plen == 0 and any(lengths[a : a + size]):
            raise ValueError(f"shared prompt: sequence {a} has an empty prompt (its first token has nothing to be predicted from)")
        ids.append(input_ids[a, :p][real])
        positions.append(position_ids[a, :p][real])
        prefixes.append((at, plen))
        at += plen
        group = []
        for b in range(a, a + size):
            m = lengths[b]
            if m == 0:
                continue
            first.append(g)
            seq.append(torch.full((m,), b))
            pos.append(torch.arange(m))
            if m > 1:
                ids.append(input_ids[b, p : p + m - 1])
                positions.append(position_ids[b, p : p + m - 1])
                group.append((at, m - 1))
                slot_cols.append(torch.arange(at, at + m - 1))
                at += m - 1
        slots.append(tuple(group))
    _require_completion(len(seq))
    lasts = torch.tensor([a + n - 1 for a, n in prefixes])
    keep = torch.cat([lasts, *slot_cols])
    prompts, kept = len(prefixes), len(keep)
    if pad := -at % bucket:  # a group of its own, attended by nothing: the last token again, positions from 0
        ids.append(ids[-1][-1:].expand(pad))
        positions.append(torch.arange(pad, dtype=position_ids.dtype, device=position_ids.device))
        prefixes.append((at, pad))
        slots.append(())
    keep = torch.cat([keep, keep[-1:].expand(-kept % bucket)])
    dev = input_ids.device
    return PackedGroups(torch.cat(ids)[None], torch.cat(positions)[None], Segments(tuple(prefixes), tuple(slots)),
                        keep.to(dev), torch.tensor(first, device=dev), torch.cat(seq).to(dev), torch.cat(pos).to(dev),
                        prompts, kept)


def shared_prompt_logprobs(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int, *,
                           entropy: bool = False, bucket: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """log π of every completion token of the padded batch (B, P + N), from one forward over `pack_groups`'
    row through `shared_prefix_attention`. Shape: (B, N) fp32, 0 past a completion's end. With `entropy`,
    also the entropy of each of those predictions, (B, N), detached.

    Logits are computed only where they predict a completion token (each prompt's last column and every
    slot column, `logits_to_keep`; up to a multiple of `bucket` of them, the row's columns too — None:
    `token_bucket`), and log-probs straight from them: no (B, N, V) tensor is built."""
    bucket = token_bucket(input_ids.device) if bucket is None else bucket
    lay = pack_groups(input_ids, attention_mask, position_ids, prompt_len, bucket=bucket)
    width = lay.input_ids.shape[1]
    with shared_prefix(model), kept_columns(model, lay.keep) as kept:  # kept: the last layer's outputs are lay.keep's
        logits = model(input_ids=lay.input_ids, position_ids=lay.position_ids,
                       attention_mask=torch.ones((1, 1, 1, width), dtype=torch.bool, device=input_ids.device),
                       segments=lay.segments, logits_to_keep=0 if kept else lay.keep, use_cache=False).logits.squeeze(0)
    groups = lay.groups  # logits (K', V): K' − lay.kept of them the bucket's repeats, read by no token
    completions = input_ids[:, prompt_len:]
    at_first = lay.pos == 0
    firsts = (lay.seq[at_first], lay.pos[at_first])      # (B',) each: every completion's token 0
    rest = (lay.seq[~at_first], lay.pos[~at_first])      # (M − B',) each: its other tokens, in slot-column order
    n_first, n_rest = lay.first.numel(), rest[0].numel()
    rows = torch.cat([lay.first, torch.arange(groups, groups + n_rest, device=logits.device)])  # each token's row
    lp = row_token_logprobs(logits, rows, torch.cat([completions[firsts], completions[rest]]))
    out = torch.zeros(completions.shape, dtype=lp.dtype, device=logits.device)
    out = out.index_put(firsts, lp[:n_first]).index_put(rest, lp[n_first:])
    if not entropy:
        return out
    with torch.no_grad():
        ent = entropy_from_logits(logits[: lay.kept].detach())             # (K,)
        h = torch.zeros(completions.shape, dtype=ent.dtype, device=ent.device)
        h[firsts], h[rest] = ent[:groups][lay.first], ent[groups:]
    return out, h
