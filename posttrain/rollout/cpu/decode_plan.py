"""One decode step of the fused forward (`fused.py`): one new token per row, every buffer pre-allocated.

`FusedDecoder.plan(cache, key_mask)` builds it; `fused.py`'s departures 5 and 6 say what it computes
and why. The work between its matmuls (RMSNorm, RoPE + cache write + attention, SwiGLU) runs as
PyTorch ops or as the C kernels of `ckernels.py`, one method each, chosen when the plan is built.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.rollout.cpu import ckernels
from posttrain.rollout.cpu.interfaces import Decoder
from posttrain.rollout.kv_cache import KVCache


class DecodePlan:
    """One decode step (q = 1 new token per row) with pre-allocated buffers (departure 6).

    Bound to one cache and its rows; `key_mask` (R, capacity) bool marks the key slots a row may
    attend to (its real prompt tokens and every generated slot). Call: `plan(tokens (R,), positions (R,))`
    → logits (R, V) fp32, valid until the next call. With the C attention only:
    - `cache_rows`: running row r reads and writes cache row `cache_rows[r]`;
    - `prefix` (a full cache, length = capacity) and `share`: every cache row c attends first to prefix
      row c // share — a prompt's keys and values, held once for its `share` samples (`fused.py`
      departure 12) — then to its own; `key_mask` is then (R, prefix.capacity + capacity).
    """

    def __init__(self, dec: Decoder, cache: KVCache, key_mask: Tensor, kind: str = "mm",
                 lib: ctypes.CDLL | None = None, cache_rows: Tensor | None = None, *,
                 prefix: KVCache | None = None, share: int = 1):
        w, dt, f32 = dec.weights, dec.compute_dtype, torch.float32
        if cache_rows is not None:
            cache_rows = cache_rows.to(torch.int64).contiguous()           # the kernel reads it by pointer
            if cache_rows.numel() and not 0 <= int(cache_rows.min()) <= int(cache_rows.max()) < cache.rows:
                raise ValueError(f"DecodePlan: cache_rows must index the cache's {cache.rows} rows")
        if prefix is not None:
            if share < 1 or prefix.rows * share < cache.rows:
                raise ValueError(f"DecodePlan: a prefix of {prefix.rows} rows, each shared by {share}, does not "
                                 f"cover the cache's {cache.rows} rows")
            if prefix.length != prefix.capacity or prefix.keys[0].dtype != cache.keys[0].dtype:
                raise ValueError("DecodePlan: the prefix must be full (length = capacity) and of the cache's dtype")
        rows = cache.rows if cache_rows is None else cache_rows.numel()
        cap, dev = cache.capacity, cache.keys[0].device
        width = cap + (0 if prefix is None else prefix.capacity)          # the key slots a row attends to
        hq, hkv, d, hidden = dec.heads, dec.kv_heads, dec.head_dim, dec.hidden
        if cache.keys[0].dtype not in (f32, torch.bfloat16):
            raise ValueError(f"DecodePlan: the KV cache must be fp32 or bf16 (FusedDecoder.cache_dtype), "
                             f"got {cache.keys[0].dtype}")
        if key_mask.shape != (rows, width):
            raise ValueError(f"DecodePlan: key_mask has shape {tuple(key_mask.shape)}, expected {(rows, width)}")
        self.dec, self.cache, self.rows, self.kind = dec, cache, rows, kind
        self.prefix, self.share = prefix, share
        self.layers, self.lm_head = w.projections(kind, rows)
        group, nqkv = hq // hkv, (hq + 2 * hkv) * d
        empty = lambda *shape, dtype=dt: torch.empty(shape, dtype=dtype, device=dev)
        self.h = empty(rows, hidden)                                       # residual stream, updated in place
        self.h32 = self.h if dt == f32 else empty(rows, hidden, dtype=f32)
        self.x = empty(rows, hidden)                                       # normalised input of a matmul
        self.ms = empty(rows, 1, 1, dtype=f32)                             # mean square + ε, then its rsqrt
        self.eps = torch.full((1, 1, 1), dec.eps, dtype=f32, device=dev)
        self.final_eps = torch.full((1, 1, 1), dec.final_eps, dtype=f32, device=dev)
        self.qkv = empty(rows, nqkv)
        self.qkv32 = self.qkv if dt == f32 else empty(rows, nqkv, dtype=f32)
        self.rot = torch.empty(rows, d // 2, dtype=torch.complex64, device=dev)
        self.qr = empty(rows, hq * d, dtype=f32)                           # rotated queries
        self.attn = empty(rows, hq * d, dtype=f32)
        self.attn_w = self.attn if dt == f32 else empty(rows, hq * d)
        inter = w.layers[0].wd.shape[1]
        self.gu = empty(rows, 2 * inter)
        self.act = empty(rows, inter)
        # views, built once
        as_c = lambda t, *shape: torch.view_as_complex(t.view(*shape, d // 2, 2))
        self.q_c = as_c(self.qkv32[:, : hq * d], rows, hq)                 # (R, Hq, D/2) complex
        self.k_c = as_c(self.qkv32[:, hq * d: (hq + hkv) * d], rows, hkv)  # (R, Hkv, D/2) complex
        self.v = self.qkv32[:, (hq + hkv) * d:].view(rows, hkv, d)         # (R, Hkv, D)
        self.qr_c = as_c(self.qr, rows, hq)
        self.rot_b = self.rot[:, None]                                     # (R, 1, D/2): broadcast over heads
        self.q3 = self.qr.view(rows * hkv, group, d)                       # GQA: a KV head's queries are rows
        self.attn3 = self.attn.view(rows * hkv, group, d)
        self.h_row, self.h_col = self.h32.view(rows, 1, hidden), self.h32.view(rows, hidden, 1)
        self.x_row = self.x.view(rows, 1, hidden)
        self.gate, self.up = self.gu[:, :inter], self.gu[:, inter:]
        if cache_rows is None and prefix is None and cache.keys[0].dtype == f32:  # the PyTorch attention's views
            self.k_cache_c = [as_c(k, rows, hkv, cap) for k in cache.keys]  # (R, Hkv, cap, D/2) complex
            self.k_flat = [k.view(rows * hkv, cap, d) for k in cache.keys]   # (R·Hkv, cap, D)
            self.v_flat = [v.view(rows * hkv, cap, d) for v in cache.values]
        bias = torch.zeros(rows, hkv, 1, width, dtype=f32, device=dev)
        self.bias = bias.masked_fill_(~key_mask[:, None, None, :], float("-inf")).view(rows * hkv, 1, width)
        self.inv_hidden = 1.0 / hidden
        # mean h² as a batched dot product is the cheapest form for one row or a short hidden size; for
        # longer rows its per-row GEMV loses to a plain reduction, worst with 2 threads (1 / 2 threads, µs
        # per norm, bmm vs mean: 64 × 128: 9 vs 15 / 9 vs 14; 1 × 512: 4 vs 12; 8 × 512: 16 vs 13 / 35 vs
        # 14; 16 × 512: 27 vs 15 / 93 vs 16; 64 × 512: 94 vs 20 / 58 vs 37)
        self.ms_rows = self.ms.view(rows, 1)
        # the step's pieces are kept as functions of the plan, not as bound methods: a bound method stored
        # on the plan is a reference cycle, and the plan — its KV cache, its packed weights — would then
        # outlive its rollout until Python's cyclic collector ran (seen as ~170 MiB more resident per GRPO
        # step at 512-token completions, tiny-30m)
        cls = DecodePlan
        self._normalise = cls._normalise_bmm if rows == 1 or hidden <= 256 else cls._normalise_mean
        self._norm, self._attention, self._swiglu = cls._norm_torch, cls._attention_torch, cls._swiglu_torch
        self.lib, self.cache_rows = lib, cache_rows
        if lib is not None:
            self._bind_c(lib, key_mask)
        if (cache_rows is not None or prefix is not None) and self._attention is DecodePlan._attention_torch:
            raise ValueError("DecodePlan: cache_rows and prefix need the C attention kernel (FusedDecoder.gathers_rows)")
        if cache.keys[0].dtype != f32 and self._attention is DecodePlan._attention_torch:
            raise ValueError("DecodePlan: a bf16 KV cache needs the C attention kernel (FusedDecoder.cache_dtype)")

    # --- the step's non-matmul work, as PyTorch ops -------------------------------------------------
    def _normalise_bmm(self, eps: Tensor) -> None:
        """x ← h / √(mean h² + ε) in fp32, cast to the weight dtype: 3 ops (the norm weight is folded)."""
        torch.baddbmm(eps, self.h_row, self.h_col, alpha=self.inv_hidden, out=self.ms)  # (R, 1, 1)
        self.ms.rsqrt_()
        torch.mul(self.h_row, self.ms, out=self.x_row)

    def _normalise_mean(self, eps: Tensor) -> None:
        """The same norm for large batches: 5 ops, no batched GEMV."""
        torch.mean(self.h32.square(), -1, keepdim=True, out=self.ms_rows)
        self.ms_rows.add_(eps.view(1, 1)).rsqrt_()
        torch.mul(self.h_row, self.ms, out=self.x_row)

    def _norm_torch(self, final: bool) -> None:
        if self.h is not self.h32:
            self.h32.copy_(self.h)
        self._normalise(self, self.final_eps if final else self.eps)

    def _attention_torch(self, i: int, slot: int) -> None:
        """RoPE on the new query and key (departure 4), the key and value into the cache, attention (5)."""
        dec, cache = self.dec, self.cache
        if self.qkv is not self.qkv32:
            self.qkv32.copy_(self.qkv)
        torch.mul(self.q_c, self.rot_b, out=self.qr_c)
        torch.mul(self.k_c, self.rot_b, out=self.k_cache_c[i].select(2, slot))  # RoPE straight into the cache
        cache.values[i].select(2, slot).copy_(self.v)
        keys, values = self.k_flat[i][:, : slot + 1], self.v_flat[i][:, : slot + 1]
        scores = torch.baddbmm(self.bias[:, :, : slot + 1], self.q3, keys.mT, alpha=dec.scaling)  # (R·Hkv, group, S)
        torch.bmm(scores.softmax(-1), values, out=self.attn3)
        if self.attn_w is not self.attn:
            self.attn_w.copy_(self.attn)

    def _swiglu_torch(self) -> None:
        F.silu(self.gate, inplace=True)
        torch.mul(self.gate, self.up, out=self.act)

    # --- the same work as C kernels (ckernels.py), their pointers bound once for this plan ----------
    def _bind_c(self, lib: ctypes.CDLL, key_mask: Tensor) -> None:
        """Point the step at the C kernels where they handle its dtypes and shapes.

        They read and write fp32 or bf16: the norm reads the residual and writes the matmul input in
        their own dtypes (no fp32 copy of the residual), the attention reads bf16 projections and writes
        bf16 output directly; an fp16 compute dtype keeps the PyTorch ops, as does a head shape the
        attention kernel does not handle (`ckernels.supports`).
        """
        dec, rows, cap = self.dec, self.rows, self.cache.capacity
        hq, hkv, d = dec.heads, dec.kv_heads, dec.head_dim
        f32, bf16 = torch.float32, torch.bfloat16
        if self.h.dtype not in (f32, bf16):
            return
        threads = torch.get_num_threads()
        is_bf16 = lambda t: int(t.dtype == bf16)
        h, x = (self.h.data_ptr(), is_bf16(self.h)), (self.x.data_ptr(), is_bf16(self.x))
        norm, hidden = lib.posttrain_rms_norm, self.h.shape[1]
        eps, final_eps = float(dec.eps), float(dec.final_eps)

        def normalise(_plan: DecodePlan, final: bool) -> None:  # no reference to the plan: see __init__
            norm(rows, hidden, *h, final_eps if final else eps, *x, threads)

        swiglu, inter = lib.posttrain_silu_mul, self.act.shape[1]
        gu_act = (self.gu.data_ptr(), self.act.data_ptr(), is_bf16(self.gu))

        def silu_mul(_plan: DecodePlan) -> None:
            swiglu(rows, inter, *gu_act, threads)

        self._norm, self._swiglu = normalise, silu_mul
        if not ckernels.supports(hq, hkv, d):
            return
        plen = 0 if self.prefix is None else self.prefix.capacity
        self.bias_rows = torch.zeros(rows, plen + cap, dtype=f32).masked_fill_(~key_mask, float("-inf"))
        self.scratch = torch.empty(threads, lib.posttrain_scratch_floats(hq // hkv, plen + cap, d), dtype=f32)
        head = (rows, hq, hkv, d, cap)
        middle = (self.qkv.data_ptr(), is_bf16(self.qkv), self.qkv.shape[1], self.rot.data_ptr())
        tail = (self.bias_rows.data_ptr(), dec.scaling, self.attn_w.data_ptr(), is_bf16(self.attn_w),
                self.attn_w.shape[1], self.scratch.data_ptr(), threads)
        rows_of = 0 if self.cache_rows is None else self.cache_rows.data_ptr()  # 0: NULL, row r is cache row r
        kv_bf16 = int(self.cache.keys[0].dtype == bf16)
        prefixes = ([(None, None)] * len(self.cache.keys) if self.prefix is None
                    else [(k.data_ptr(), v.data_ptr()) for k, v in zip(self.prefix.keys, self.prefix.values)])
        caches = [(k.data_ptr(), v.data_ptr(), kv_bf16, rows_of, *pkv, plen, self.share)
                  for k, v, pkv in zip(self.cache.keys, self.cache.values, prefixes)]
        attend = lib.posttrain_decode_attention

        def attention(_plan: DecodePlan, i: int, slot: int) -> None:
            if attend(*head, slot, *middle, *caches[i], *tail) != 0:
                raise RuntimeError(f"DecodePlan: the C attention kernel refused {head} at slot {slot}")

        self._attention = attention

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        dec, w, cache = self.dec, self.dec.weights, self.cache
        slot = cache.length
        if slot >= cache.capacity:
            raise RuntimeError(f"DecodePlan: writing position {slot} but the cache capacity is {cache.capacity}")
        if positions.numel() and int(positions.max()) >= dec._rope_len:  # host sync; cheap on CPU
            raise RuntimeError(f"FusedDecoder: position {int(positions.max())} beyond prepare({dec._rope_len})")
        torch.index_select(w.embed, 0, tokens, out=self.h)
        torch.index_select(dec._rot, 0, positions, out=self.rot)
        for i, lp in enumerate(self.layers):
            self._norm(self, False)
            lp.qkv.into(self.x, self.qkv)
            self._attention(self, i, slot)
            lp.o.add_to(self.attn_w, self.h)
            self._norm(self, False)
            lp.gu.into(self.x, self.gu)
            self._swiglu(self)
            lp.d.add_to(self.act, self.h)
        cache.advance(1)
        self._norm(self, True)
        return self.lm_head(self.x).float()                               # (R, V)
