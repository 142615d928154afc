"""Deterministic epoch sampling whose whole state is a small dict, for exact resume.

Each epoch visits a permutation of `range(n)` drawn from `numpy.random.default_rng(seed + epoch)`
(so epoch e's order depends on nothing but the seed and e, not on how many batches came before),
in batches of `batch_size`. The state is `{epoch, position, seed}` plus the shape it was made for
(`n`, `batch_size`, `shuffle`, `drop_last`), all ints/bools, JSON-serializable: a run killed after
batch b of epoch e and restored from `state_dict()` yields exactly batch b+1 next.

`drop_last=True` (the default for training) drops each epoch's final partial batch, so every step
sees `batch_size` rows; thanks to the per-epoch shuffle a different remainder is dropped each epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")
B = TypeVar("B")

_STATE_KEYS = ("epoch", "position", "seed", "n", "batch_size", "shuffle", "drop_last")


class EpochSampler:
    """Batches of indices into a dataset of `n` items, epoch after epoch, forever."""

    def __init__(self, n: int, batch_size: int, *, seed: int, shuffle: bool = True, drop_last: bool = True):
        if n < 1:
            raise ValueError(f"cannot sample batches from an empty dataset (n={n})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        if drop_last and batch_size > n:
            raise ValueError(f"batch_size {batch_size} is larger than the dataset ({n} items) with drop_last=True; "
                             "expected batch_size ≤ n")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0
        self.position = 0  # batches already taken in this epoch
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation) cache

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The visiting order of epoch `epoch`. Shape: (n,)."""
        if self._order is None or self._order[0] != epoch:
            perm = np.random.default_rng(self.seed + epoch).permutation(self.n) if self.shuffle else np.arange(self.n)
            self._order = (epoch, perm)
        return self._order[1]

    def next_batch(self) -> list[int]:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        batch = self.order(self.epoch)[start : start + self.batch_size]
        self.position += 1
        return [int(i) for i in batch]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`. The dataset shape must match: resuming onto a changed dataset
        cannot give the same batches, so it is an error rather than a silent reshuffle."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"sampler state is missing {missing}; expected keys {list(_STATE_KEYS)}")
        for key in ("n", "batch_size", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state was saved with {key}={state[key]!r} but this run has "
                                 f"{key}={getattr(self, key)!r}; the data or batch size changed since the checkpoint")
        if not (0 <= state["position"] <= self.batches_per_epoch) or state["epoch"] < 0:
            raise ValueError(f"sampler state epoch={state['epoch']} position={state['position']} is out of range "
                             f"(0..{self.batches_per_epoch} batches per epoch)")
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        self._order = None


class BatchIterator(Generic[T, B]):
    """`collate([items[i] for i in batch])` for each batch of an `EpochSampler`; infinite."""

    def __init__(self, items: Sequence[T], batch_size: int, collate: Callable[[list[T]], B], *, seed: int,
                 shuffle: bool = True, drop_last: bool = True):
        self.items = items
        self.collate = collate
        self.sampler = EpochSampler(len(items), batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __iter__(self) -> BatchIterator[T, B]:
        return self

    def __next__(self) -> B:
        return self.collate([self.items[i] for i in self.sampler.next_batch()])

    def state_dict(self) -> dict[str, int | bool]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
