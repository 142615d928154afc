"""Batches: right-padded SFT/preference tensors, packed pretraining rows, and a weighted mix of sources.

`mix` semantics (chosen for exact, testable proportions rather than sampling noise): each source gets
a quota of the `n` draws proportional to its weight (largest-remainder rounding, ties to the earlier
source), its items are taken by walking seeded permutations of it (every item once before any item
twice — "epochs" of the source, so a small source is repeated as evenly as possible), and the drawn
items are shuffled together. Deterministic for a seed.

`pack_documents` follows GPT-2/nanoGPT pretraining: documents, each followed by an EOS token, are
concatenated into one stream and cut into rows of `seq_len`; attention crosses document boundaries
(the EOS tells the model a new document starts) and the tail shorter than a row is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

from posttrain.data.encoding import IGNORE_INDEX, EncodedPreference

T = TypeVar("T")


class _Encoded(Protocol):
    input_ids: list[int]
    labels: list[int]


class SFTBatch(NamedTuple):
    input_ids: Tensor  # (B, T) int64, right-padded with pad_id
    attention_mask: Tensor  # (B, T) int64, 1 on real tokens
    labels: Tensor  # (B, T) int64, IGNORE_INDEX on prompt and padding


class PreferenceBatch(NamedTuple):
    """Chosen and rejected padded to the same T, so `torch.cat` gives one (2B, T) forward."""

    chosen: SFTBatch
    rejected: SFTBatch
    prompt_lens: Tensor  # (B,) int64


def collate_sft(encoded: Sequence[_Encoded], pad_id: int, *, pad_to: int | None = None) -> SFTBatch:
    """Right-pad to the longest sequence (or `pad_to`). Shape: (B, T)."""
    if not encoded:
        raise ValueError("collate_sft got an empty batch")
    longest = max(len(e.input_ids) for e in encoded)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest sequence in the batch ({longest} tokens)")
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(encoded), width), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    attn = torch.zeros((len(encoded), width), dtype=torch.long)  # (B, T)
    for row, e in enumerate(encoded):
        if len(e.labels) != len(e.input_ids):
            raise ValueError(f"batch row {row}: {len(e.input_ids)} input_ids but {len(e.labels)} labels")
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        labels[row, :n] = torch.tensor(e.labels, dtype=torch.long)
        attn[row, :n] = 1
    return SFTBatch(ids, attn, labels)


def collate_preference(encoded: Sequence[EncodedPreference], pad_id: int) -> PreferenceBatch:
    """Chosen and rejected right-padded to one common length T. Shapes: (B, T) each, prompt_lens (B,)."""
    if not encoded:
        raise ValueError("collate_preference got an empty batch")
    width = max(max(len(e.chosen.input_ids), len(e.rejected.input_ids)) for e in encoded)
    chosen = collate_sft([e.chosen for e in encoded], pad_id, pad_to=width)
    rejected = collate_sft([e.rejected for e in encoded], pad_id, pad_to=width)
    return PreferenceBatch(chosen, rejected, torch.tensor([e.prompt_len for e in encoded], dtype=torch.long))


def pack_documents(docs: Iterable[Sequence[int]], seq_len: int, *, eos_id: int) -> Tensor:
    """Concatenate documents, each followed by `eos_id`, into rows of `seq_len` tokens. Shape: (N, seq_len).
    Labels for pretraining are the rows themselves (the model shifts them)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be ≥ 1, got {seq_len}")
    stream: list[int] = []
    for doc in docs:
        stream.extend(doc)
        stream.append(eos_id)
    n_rows = len(stream) // seq_len
    if n_rows == 0:
        raise ValueError(f"the corpus is {len(stream)} tokens (EOS included), shorter than one row of seq_len {seq_len}")
    return torch.tensor(stream[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)  # (N, seq_len)


def mix_quotas(weights: Sequence[float], n: int) -> list[int]:
    """How many of `n` draws each source gets: n·w/Σw, largest-remainder rounding, ties to the earlier source."""
    if n < 0:
        raise ValueError(f"n must be ≥ 0, got {n}")
    if not weights:
        raise ValueError("mix needs at least one source")
    for i, w in enumerate(weights):
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise ValueError(f"source {i}: weight {w!r}; expected a finite number ≥ 0")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"mix weights {list(weights)} sum to 0; expected at least one positive weight")
    exact = [n * w / total for w in weights]
    quotas = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in by_remainder[: n - sum(quotas)]:
        quotas[i] += 1
    return quotas


def mix_indices(sizes: Sequence[int], weights: Sequence[float], n: int, seed: int) -> list[tuple[int, int]]:
    """The (source, item index) pairs `mix` draws, in order."""
    if len(sizes) != len(weights):
        raise ValueError(f"{len(sizes)} sources but {len(weights)} weights")
    quotas = mix_quotas(weights, n)
    rng = np.random.default_rng(seed)
    drawn: list[tuple[int, int]] = []
    for s, (size, quota) in enumerate(zip(sizes, quotas)):
        if quota and size == 0:
            raise ValueError(f"source {s} is empty but has weight {weights[s]}; expected items or weight 0")
        passes = -(-quota // size) if quota else 0
        order = np.concatenate([rng.permutation(size) for _ in range(passes)]) if passes else np.array([], dtype=int)
        drawn.extend((s, int(i)) for i in order[:quota])
    return [drawn[i] for i in rng.permutation(len(drawn))]


def mix(sources: Sequence[tuple[Sequence[T], float]], n: int, seed: int) -> list[T]:
    """`n` items drawn from weighted sources (see the module docstring for the semantics)."""
    seqs = [s for s, _ in sources]
    picks = mix_indices([len(s) for s in seqs], [w for _, w in sources], n, seed)
    return [seqs[s][i] for s, i in picks]
