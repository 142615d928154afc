"""A bounded prefix cache: rows' KV kept between `generate` calls, keyed by the exact token ids it covers.

The idea is vLLM's automatic prefix caching and SGLang's RadixAttention (Zheng et al. 2024, "SGLang:
Efficient Execution of Structured Language Model Programs", §3): a later prompt that starts with a
sequence whose keys and values are already computed prefills only the rest. Here it serves multi-turn
episodes (`envs.episodes`): turn k + 1's prompt is turn k's prompt, its sampled tokens and the
environment's text, so the entry turn k left covers all of it but the last sampled token and the
environment's tokens.

Departures (numbered):
1. Only what a caller asks for is kept: `generate(..., keep=[key or None per row])` stores row j under
   the caller's `key` (replacing what that key held), and the caller `release`s keys it is done with.
   No radix tree, no automatic retention of every prompt: one entry per key, a linear scan on lookup
   (entries are a batch's rows, tens, and the scan compares token tuples in C).
2. An entry holds one contiguous copy of the row's keys and values, (kv_heads, C, head_dim) per layer,
   in the cache dtype (no paged blocks, no sharing between entries: two rows that sampled the same
   tokens keep two copies).
3. Bounded by bytes (`max_bytes`): storing past the cap evicts the oldest entries first; an entry
   larger than the whole cap is not kept.
4. Never across weights: `clear` on every weight update, and a stamp of the weights (each parameter's
   storage and in-place version, the LoRA adapters' state) checked at every call clears it on a change
   nobody announced.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from torch import Tensor


@dataclass
class PrefixEntry:
    """One kept row. C = len(ids) positions, all of them real tokens (no pads)."""

    ids: tuple[int, ...]   # (C,) the token ids the keys/values cover, positions 0 … C − 1
    keys: list[Tensor]     # per layer (kv_heads, C, head_dim), RoPE applied at those positions
    values: list[Tensor]   # per layer (kv_heads, C, head_dim)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)


@dataclass
class PrefixStats:
    """Running totals since the cache was made (never reset by `clear`)."""

    lookups: int = 0          # prompts looked up
    hits: int = 0             # prompts that started from an entry
    hit_tokens: int = 0       # prompt tokens not prefilled thanks to an entry (the prefill saved)
    stored: int = 0           # entries stored
    evicted: int = 0          # entries dropped to stay under the byte cap
    refused: int = 0          # rows asked to be kept but larger than the whole cap
    cleared: int = 0          # entries dropped by a weight change


class PrefixCache:
    """Kept rows by caller key; `lookup` by token ids. Not thread-safe (one engine, one caller)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"PrefixCache: max_bytes={max_bytes}; expected ≥ 0 (0 keeps nothing)")
        self.max_bytes = max_bytes
        self.entries: dict[Hashable, PrefixEntry] = {}  # insertion order = age: the first is evicted first
        self.bytes = 0
        self.stats = PrefixStats()
        self._stamp: object = None

    def __len__(self) -> int:
        return len(self.entries)

    def check(self, stamp: object) -> None:
        """Clear everything if the weights' `stamp` differs from the one the entries were made under."""
        if stamp != self._stamp:
            self.stats.cleared += len(self.entries)
            self.clear()
            self._stamp = stamp

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def lookup(self, prompt: Sequence[int], key: Hashable | None = None) -> PrefixEntry | None:
        """The longest entry whose ids are a proper prefix of `prompt` (at least one token is left to
        prefill: its logits sample the first new token). `key`'s own entry is tried first (the usual
        hit: an episode's previous turn)."""
        self.stats.lookups += 1
        best = None
        own = self.entries.get(key) if key is not None else None
        candidates = [own] if own is not None and _extends(prompt, own.ids) else self.entries.values()
        for e in candidates:
            if (best is None or len(e.ids) > len(best.ids)) and _extends(prompt, e.ids):
                best = e
        if best is not None:
            self.stats.hits += 1
            self.stats.hit_tokens += len(best.ids)
        return best

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.max_bytes

    def store(self, key: Hashable, entry: PrefixEntry) -> bool:
        """Keep `entry` under `key` (replacing the key's old entry); evict the oldest entries while over
        the cap. False (nothing kept, the key's old entry dropped) if it alone is larger than the cap."""
        self.release([key])
        nbytes = entry.nbytes
        if not self.fits(nbytes):
            self.refuse(key)
            return False
        while self.bytes + nbytes > self.max_bytes:
            oldest = next(iter(self.entries))
            self.bytes -= self.entries.pop(oldest).nbytes
            self.stats.evicted += 1
        self.entries[key] = entry
        self.bytes += nbytes
        self.stats.stored += 1
        return True

    def refuse(self, key: Hashable) -> None:
        """A row too large for the cap: not kept, and the key's old entry (now superseded) dropped."""
        self.release([key])
        self.stats.refused += 1

    def release(self, keys: Iterable[Hashable]) -> None:
        """Drop the entries of `keys` (unknown keys are ignored: an entry may have been evicted)."""
        for k in keys:
            e = self.entries.pop(k, None)
            if e is not None:
                self.bytes -= e.nbytes


def _extends(prompt: Sequence[int], ids: tuple[int, ...]) -> bool:
    return len(ids) < len(prompt) and tuple(prompt[:len(ids)]) == ids
