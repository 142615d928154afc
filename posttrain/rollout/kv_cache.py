"""A pre-allocated KV cache: one (rows, kv_heads, capacity, head_dim) buffer per layer, written in place.

All rows of a left-padded batch write the same slot at each step (their prompts end together), so
one integer `length` is the whole cache state; no per-step concatenation, no per-row offsets.
`hf()` wraps the same buffers as a `transformers` `Cache` (5.x API: models take it as `cache=`,
call `cache.update(k, v, layer_idx)` inside attention, and size their masks with
`get_mask_sizes`), so any HF causal LM can run on it unchanged.
The fused path (`fused.py`) allocates it in fp32 and stores its keys already rotated, with the
rotary pairs of each head side by side; `DecodePlan` writes the new key straight into its slot.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin


class KVCache:
    """Keys and values of every layer. Shape per layer: (rows, kv_heads, capacity, head_dim)."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], length: int = 0):
        self.keys, self.values, self.length = keys, values, length
        self._hf: Cache | None = None

    @classmethod
    def allocate(cls, *, layers: int, rows: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (rows, kv_heads, capacity, head_dim)
        return cls([torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)],
                   [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)])

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def nbytes(self) -> int:
        """The bytes its buffers hold (keys and values of every layer)."""
        return sum(t.nbytes for t in (*self.keys, *self.values))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store q new positions at [length, length + q) of `layer`; return views of everything so far.

        The caller calls `advance(q)` once after the whole forward (every layer wrote the same slots).
        """
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KVCache: writing up to position {end} but capacity is {self.capacity}")
        self.keys[layer][:, :, self.length:end].copy_(k)
        self.values[layer][:, :, self.length:end].copy_(v)
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, q: int) -> None:
        self.length += q

    def expand(self, repeats: int, capacity: int) -> KVCache:
        """A new cache with each row repeated `repeats` times (prompt-major) and room for `capacity`.

        This is where the n samples of a prompt start sharing its prefill: one copy of the prompt's
        keys/values per sample, no recomputation.
        """
        out = []
        for bufs in (self.keys, self.values):
            grown = []
            for b in bufs:
                new = b.new_empty((b.shape[0] * repeats, b.shape[1], capacity, b.shape[3]))
                new[:, :, :self.length] = b[:, :, :self.length].repeat_interleave(repeats, 0)
                grown.append(new)
            out.append(grown)
        return KVCache(out[0], out[1], self.length)

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` (compaction of finished sequences). Costs one copy of the kept rows."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]

    def hf(self) -> Cache:
        """The same buffers as a `transformers` Cache (built once; it reads this object's buffers live)."""
        if self._hf is None:
            self._hf = _HFCache(self)
        return self._hf


class _HFLayer(CacheLayerMixin):
    """One layer of `KVCache` behind the `transformers` cache-layer interface. It holds its cache weakly:
    the cache holds it (`KVCache.hf`), and a reference cycle would keep every rollout's buffers alive until
    Python's cyclic collector ran."""

    is_compileable = False
    is_sliding = False

    def __init__(self, parent: KVCache, index: int):
        super().__init__()
        self._parent, self.index = weakref.ref(parent), index
        self.is_initialized = True

    @property
    def parent(self) -> KVCache:
        cache = self._parent()
        if cache is None:
            raise RuntimeError("KVCache.hf(): the KVCache these layers read was freed; keep it while its hf() is in use")
        return cache

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:  # buffers already exist
        return None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return self.parent.write(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.parent.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.parent.length

    def get_max_length(self) -> int:
        return self.parent.capacity


class _HFCache(Cache):
    def __init__(self, parent: KVCache):
        super().__init__(layers=[_HFLayer(parent, i) for i in range(len(parent.keys))])
