"""What the decode step (`decode_plan.py`) and the tuner (`tuning.py`) read from the fused decoder.

Declared here, below `fused.py`, so that neither imports it: `fused.py` builds plans and asks the
tuner, so an import back from either would be a cycle. `fused.FusedWeights` and `fused.FusedDecoder`
are the one implementation of each protocol (structural typing: they do not name these classes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from posttrain.rollout.cpu.projections import MatmulForm


class LayerWeights(Protocol):
    """One layer's fused copies, HF's (out, in) layout."""

    wqkv: Tensor          # ((Hq + 2·Hkv)·D, H)
    bqkv: Tensor | None
    wo: Tensor            # (H, Hq·D)
    bo: Tensor | None
    wgu: Tensor           # (2·I, H): [gate | up]
    wd: Tensor            # (H, I)


class LayerForms(Protocol):
    """One layer's four decode matmuls in one form."""

    qkv: MatmulForm
    o: MatmulForm
    gu: MatmulForm
    d: MatmulForm


class DecodeWeights(Protocol):
    layers: Sequence[LayerWeights]
    embed: Tensor         # (V, H)
    nbytes: int           # bytes of every layer's four matmul weights

    def projections(self, kind: str, rows: int) -> tuple[Sequence[LayerForms], MatmulForm]:
        """Every layer's decode matmuls and the LM head in form `kind`, for `rows` rows."""
        ...


class Decoder(Protocol):
    """The geometry and state a `DecodePlan` reads from its decoder."""

    weights: DecodeWeights
    compute_dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    eps: float
    final_eps: float
    scaling: float
    _rope_len: int        # positions the rotary table holds (set by `FusedDecoder.prepare`)
    _rot: Tensor          # (positions, D/2) complex64 rotary table
