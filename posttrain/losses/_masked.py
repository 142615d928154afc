"""Masked reductions and the input checks every loss shares.

A mask is a bool tensor, or a float/int tensor of 0s and 1s, the shape of the values it selects.
Reductions use `torch.where`, never `x * mask`: a padded position may hold `inf` (an overflowed
ratio), and `inf * 0 = nan` would poison the sum.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_same_shape(where: str, ref_name: str, ref: Tensor, **others: Tensor) -> None:
    """Raise a ValueError naming the function, the argument and the expected shape."""
    for name, t in others.items():
        if t.shape != ref.shape:
            raise ValueError(
                f"{where}: {name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)} like {ref_name}"
            )


def check_ndim(where: str, name: str, t: Tensor, ndim: int, meaning: str) -> None:
    if t.ndim != ndim:
        raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, expected {ndim} dims {meaning}")


def check_positive(where: str, **values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{where}: {name} must be > 0, got {v}")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    keep = mask.bool()
    picked = x.masked_fill(~keep, 0)
    return picked.sum() if dim is None else picked.sum(dim)


def masked_count(mask: Tensor, dim: int | None = None, *, dtype: torch.dtype | None = None) -> Tensor:
    keep = mask.bool()
    count = keep.sum() if dim is None else keep.sum(dim)
    return count if dtype is None else count.to(dtype)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over the kept positions; 0 where nothing is kept (used for stats, never as a normalizer)."""
    count = masked_count(mask, dim, dtype=x.dtype if x.is_floating_point() else None).clamp_min(1)
    return masked_sum(x, mask, dim) / count
