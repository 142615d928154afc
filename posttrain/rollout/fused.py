"""A lean forward for Llama-family decoders (Llama, Qwen2, Mistral without sliding window), for decoding.

It computes what `LlamaForCausalLM.forward` computes — RMSNorm → attention with RoPE → RMSNorm →
SwiGLU MLP, residuals, final norm, LM head (Touvron et al. 2023, "LLaMA", §2.2) — reading the HF
module's own parameters and its own rotary module (so rope-scaling variants come for free), with
far fewer tensor ops per token: on a small model each op costs a fixed ~5–20 µs on a CPU whatever
its size, so the op count *is* the decode step.

Departures from the HF forward (numbered):
1. Fused weights, built once and rebuilt only when a source parameter changes (its in-place version
   counter moves, as after an optimizer step): Q/K/V are one matmul, gate/up are one matmul.
2. The fused copies keep HF's (out, in) layout, written in one pass each from the parameters (fp32
   weights without a folded norm are the parameters themselves, no copy). Each decode matmul then
   takes the form measured fastest for its dtype and row count (`projection_kind`): packed MKL or
   oneDNN weights, or a pre-transposed (in, out) copy multiplied with `torch.mm`/`addmm` — MKL's sgemm
   runs "NN" up to 2× faster than `F.linear`'s "NT" at 8 rows on an Intel Xeon (docs/rollout.md). The
   fastest form depends on the CPU (on an AMD EPYC oneDNN wins everywhere, by 2–4×), so for weights that
   stream from memory it is measured on the machine (`tuning.tuned_kind`); `projection_kind` is the
   static prior (`projections.py`). Prefill uses the decode step's packed weights when its form is
   oneDNN's, else `F.linear` on the (out, in) copies.
3. RMSNorm weights are folded into the next matmul: RMSNorm(x)·W = (x·s)(diag(w)·W) with the per-row
   scale s = 1/√(mean x² + ε) — exact in real arithmetic, one rounding of w·W in floating point.
4. RoPE as one complex multiply: the rows of W_q and W_k are permuted within each head so that
   HF's pairs (i, i + D/2) sit side by side; then x·cos + rotate_half(x)·sin is
   (x_i + i·x_{i+D/2})·(cos_i + i·sin_i). q·k is unchanged by permuting both the same way; the cache
   holds the permuted keys (only this forward reads it). cos/sin are tabulated once per `generate`.
5. Attention runs in fp32 whatever the weight dtype. The KV cache is fp32, or bf16 when the step
   computes in bf16 and the C attention kernel reads it (its keys and values are bf16 matmul outputs
   already; the rotated key is rounded once more, as in a bf16 HF forward). In a decode step on a CPU
   it is one C call per layer (`ckernels.py`: RoPE, the cache write, scores, masked softmax and the
   value sum), as are the RMSNorms and silu(gate)·up; elsewhere, or with `decode_ops="torch"`, scores,
   softmax and the value sum are three batched ops (`baddbmm` with the pad mask as its additive
   input, `softmax`, `bmm`); GQA groups the query heads of one KV head into the rows of one small
   matmul (no repeat_kv). Prefill (many new tokens) uses SDPA on the same tensors.
6. Decode steps (one new token per row) run through a `DecodePlan`: every intermediate has a
   pre-allocated buffer and every view is built once, so a step allocates almost nothing; the
   residual stream is updated in place (`addmm_`). With the C attention a plan can read each row's
   keys and values at another cache row (`cache_rows`), so compaction copies no cache.
7. No mask factory, no output capture, no decorators; only the last position's logits are computed.
8. Optional weight dtype (e.g. bf16 weights for a fp32 policy): the fused copies are cast; norms and
   attention stay in fp32; logits are returned in fp32 either way.
9. Prefill skips padding: the matmuls and MLP run on the real prompt tokens only (a batch of mixed
   lengths pads ~30 % of its rows); attention runs on the padded layout, where pads are masked.
10. Small bf16/fp16 weights on a CPU are multiplied in fp32 (`compute_dtype`): the copies hold what
   the bf16 copies would (the bf16 values, a folded norm rounded once to bf16 as in 3), widened
   exactly; activations are then not rounded to bf16 between ops, so the log-probs sit closer to the
   exact ones of the bf16 weights than a bf16 forward's do.
`HFForward` in `native.py` is the naive version; `FusedDecoder.__call__` (any number of new tokens)
is the reference for `DecodePlan` (one); `tests/test_rollout_native.py` proves all three agree.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.rollout import ckernels
from posttrain.rollout.kv_cache import KVCache
from posttrain.rollout.projections import PROJECTION_KINDS, Projection, compute_dtype
from posttrain.rollout.tuning import tuned_kind

FUSED_MODEL_TYPES = ("llama", "qwen2", "mistral")
DECODE_OPS = ("auto", "c", "c-generic", "torch")  # "c-generic": the C kernels' plain-C loops (tests)


def fused_unsupported_reason(model: nn.Module) -> str | None:
    """None if `FusedDecoder` can run `model`, else why not (the engine then uses the HF forward)."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in FUSED_MODEL_TYPES:
        return f"model_type {mtype!r} is not one of {FUSED_MODEL_TYPES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (the fused MLP is SwiGLU with SiLU)"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or (mtype == "mistral" and cfg.sliding_window):
        return "sliding-window attention layers"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if "dynamic" in str(rope.get("rope_type", rope.get("type", "default"))):
        return "dynamic RoPE scaling (its frequencies depend on the running length; the fused path tabulates them)"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "module layout differs from LlamaModel (embed_tokens, layers, norm, rotary_emb)"
    if not hasattr(model, "lm_head"):
        return "no lm_head"
    return None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's LlamaRMSNorm, op for op: normalise in fp32, cast back, then scale (the naive version)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_fused(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The same norm as one ATen op; in bf16 it rounds once instead of twice."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def _normalise(x: Tensor, eps: float) -> Tensor:
    """x·s, s = 1/√(mean x² + ε), computed in fp32 and returned in x's dtype (the weight is folded, dep. 3)."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def pair_halves(head_dim: int) -> Tensor:
    """Feature order within a head that puts HF's rotary pair (i, i + D/2) at (2i, 2i + 1) (departure 4)."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], -1).flatten()  # (D,)


@dataclass
class _Layer:
    wqkv: Tensor          # ((Hq + 2·Hkv)·D, H), input norm folded, Q/K features paired
    bqkv: Tensor | None   # ((Hq + 2·Hkv)·D,)
    wo: Tensor            # (H, Hq·D)
    bo: Tensor | None     # (H,)
    wgu: Tensor           # (2·I, H), post-attention norm folded: [gate | up]
    wd: Tensor            # (H, I)


class FusedWeights:
    """Fused (and optionally cast) copies of a Llama-family model's weights in HF's (out, in) layout,
    kept in sync; plus the decode-step forms of them (`projections`), rebuilt with them.

    A rebuild reads every parameter once and writes each copy once, into the buffers of the previous
    build (a policy's weights change after every optimizer step, so this runs once per rollout):
    rotary pairing is a strided view of the Q/K rows, the norm fold and the cast are one `mul`.

    dtype: the precision of the weight values (None = the parameters'); compute: the dtype the copies
    are stored and multiplied in (None = dtype). A compute dtype wider than dtype holds the rounded
    values exactly (bf16 values in fp32: departure 10).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None, compute: torch.dtype | None = None):
        self.model, self.dtype, self.compute = model, dtype, compute
        self._params = list(model.parameters())
        self._key: tuple | None = None
        self._buffers: dict[str, Tensor] = {}
        self.layers: list[_Layer] = []
        self._projections: dict[str, tuple[int, list[_LayerProjections], Projection]] = {}

    def _version(self) -> tuple:
        # A parameter's `_version` moves on every in-place write (optimizer.step, load_state_dict, copy_),
        # and `data_ptr` moves when it is replaced: together they say when the copies are stale.
        return tuple((p.data_ptr(), p._version) for p in self._params)

    def invalidate(self) -> None:
        """Rebuild at the next `refresh` whatever the version counters say (a fused optimizer step writes
        parameters without bumping them)."""
        self._key = None

    def _buffer(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """The previous build's tensor `name` if it has this shape, dtype and device, else a new one."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != self._dt or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(shape, dtype=self._dt, device=like.device)
        return buf

    def _copy(self, name: str, w: Tensor, norm: Tensor | None = None) -> Tensor:
        """w (out, in) with the norm weight folded into its columns, in the copies' dtype. An fp32 weight
        with nothing to fold is returned as is (a detached view of the parameter)."""
        w = w.detach()
        if norm is None and w.dtype == self._dt:
            return w
        out = self._buffer(name, tuple(w.shape), w)
        return out.copy_(w) if norm is None else torch.mul(w, norm.detach(), out=out)

    def _qkv(self, name: str, a: nn.Module, norm: Tensor, heads: int, kv_heads: int, d: int) -> Tensor:
        """[W_q; W_k; W_v] with the norm folded and each Q/K head's rows in `pair_halves` order (departure 4):
        the pairing is the view (heads, 2, D/2, H) → (heads, D/2, 2, H), so the gather is the `mul`'s read."""
        hidden = a.q_proj.weight.shape[1]
        out = self._buffer(name, ((heads + 2 * kv_heads) * d, hidden), a.q_proj.weight)
        n = norm.detach()
        q, k = out[: heads * d], out[heads * d : (heads + kv_heads) * d]
        torch.mul(_paired(a.q_proj.weight.detach(), heads, d), n, out=q.view(heads, d // 2, 2, hidden))
        torch.mul(_paired(a.k_proj.weight.detach(), kv_heads, d), n, out=k.view(kv_heads, d // 2, 2, hidden))
        torch.mul(a.v_proj.weight.detach(), n, out=out[(heads + kv_heads) * d :])
        return out

    def refresh(self) -> None:
        """Rebuild the fused copies if any source parameter changed since the last build (or `invalidate`)."""
        key = self._version()
        if key == self._key:
            return
        m = self.model
        if any(getattr(mod, "bias", None) is not None for layer in m.model.layers
               for mod in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)):
            raise ValueError("FusedWeights: MLP biases are not supported (mlp_bias=True); use kernels='hf'")
        self._dt = dt = self.dtype or next(m.parameters()).dtype
        heads, kv_heads = m.config.num_attention_heads, m.config.num_key_value_heads
        d = m.model.layers[0].self_attn.head_dim

        layers = []
        for i, layer in enumerate(m.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            bqkv = None
            if any(b is not None for b in biases):
                bq, bk, bv = (b.detach() if b is not None else torch.zeros(p.weight.shape[0], dtype=p.weight.dtype,
                                                                             device=p.weight.device)
                              for b, p in zip(biases, (a.q_proj, a.k_proj, a.v_proj)))
                bqkv = torch.cat([_paired(bq, heads, d).reshape(-1), _paired(bk, kv_heads, d).reshape(-1), bv]).to(dt)
            gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
            wgu = self._buffer(f"{i}.gu", (gate.shape[0] + up.shape[0], gate.shape[1]), gate)
            norm = layer.post_attention_layernorm.weight.detach()
            torch.mul(gate.detach(), norm, out=wgu[: gate.shape[0]])
            torch.mul(up.detach(), norm, out=wgu[gate.shape[0]:])
            layers.append(_Layer(
                wqkv=self._qkv(f"{i}.qkv", a, layer.input_layernorm.weight, heads, kv_heads, d),
                bqkv=bqkv,
                wo=self._copy(f"{i}.o", a.o_proj.weight),
                bo=None if a.o_proj.bias is None else a.o_proj.bias.detach().to(dt),
                wgu=wgu,
                wd=self._copy(f"{i}.d", mlp.down_proj.weight),
            ))
        embed = self._copy("embed", m.model.embed_tokens.weight)                # (V, H)
        lm_head = self._copy("lm_head", m.lm_head.weight, m.model.norm.weight)  # (V, H), final norm folded
        bias = getattr(m.lm_head, "bias", None)
        lm_head_bias = None if bias is None else bias.detach().to(dt)
        if self.compute is not None and self.compute != dt:                    # the rounded values, widened
            self._dt = self.compute
            widen = lambda name, t: None if t is None else self._buffer(name + ".w", tuple(t.shape), t).copy_(t)
            layers = [_Layer(**{f: widen(f"{i}.{f}", getattr(lw, f)) for f in _Layer.__dataclass_fields__})
                      for i, lw in enumerate(layers)]
            embed, lm_head, lm_head_bias = widen("embed", embed), widen("lm_head", lm_head), widen("lm_bias", lm_head_bias)
        self.layers, self.embed, self.lm_head, self.lm_head_bias = layers, embed, lm_head, lm_head_bias
        self._projections = {}
        self.nbytes = sum(t.numel() * t.element_size() for lw in self.layers for t in (lw.wqkv, lw.wo, lw.wgu, lw.wd))
        self._key = key

    def projections(self, kind: str, rows: int) -> tuple[list[_LayerProjections], Projection]:
        """Every decode matmul in form `kind` for `rows` rows; the last build per kind is kept (packing
        costs about one pass over the weights, so a plan rebuilt for the same rows reuses it)."""
        cached = self._projections.get(kind)
        # mm, dnn: any rows (for dnn, rows is only a hint); mkl: pads up to the packed rows (repack only
        # below half of them). A compaction of the batch rebuilds the plan, not the weights.
        if cached is not None and (cached[0] == rows or kind in ("mm", "dnn", "c")
                                   or (kind == "mkl" and rows <= cached[0] < 2 * rows)):
            return cached[1], cached[2]
        layers = [_LayerProjections(qkv=Projection(lw.wqkv, lw.bqkv, kind, rows), o=Projection(lw.wo, lw.bo, kind, rows),
                                    gu=Projection(lw.wgu, None, kind, rows), d=Projection(lw.wd, None, kind, rows))
                  for lw in self.layers]
        lm_head = Projection(self.lm_head, self.lm_head_bias, kind, rows)
        self._projections[kind] = (rows, layers, lm_head)
        return layers, lm_head


def _paired(w: Tensor, heads: int, d: int) -> Tensor:
    """Rows (heads·D, …) viewed as (heads, D/2, 2, …) in `pair_halves` order: element (h, i, j) is row h·D + j·D/2 + i."""
    return w.view(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2)


@dataclass
class _LayerProjections:
    qkv: Projection
    o: Projection
    gu: Projection
    d: Projection


class FusedDecoder:
    """`step(ids, positions, cache, key_mask) -> last-position logits`, for Llama-family models."""

    cache_dtype = torch.float32  # departure 5: attention in fp32; the cache fp32, or bf16 (set by `prepare`)

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None, *, matmul: str = "auto",
                 compute: torch.dtype | str = "auto", decode_ops: str = "auto"):
        reason = fused_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FusedDecoder cannot run this model: {reason}")
        if matmul != "auto" and matmul not in PROJECTION_KINDS:
            raise ValueError(f"FusedDecoder: matmul={matmul!r}; expected 'auto' or one of {PROJECTION_KINDS}")
        if decode_ops not in DECODE_OPS:
            raise ValueError(f"FusedDecoder: decode_ops={decode_ops!r}; expected one of {DECODE_OPS}")
        self.matmul = matmul  # decode-step matmul form; "auto" = tuning.tuned_kind (measured on this machine)
        self.decode_ops = decode_ops  # the decode step's non-matmul work: "auto" = C kernels on a CPU where they build
        self.model = model
        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.hidden = cfg.hidden_size
        self.scaling = attn.scaling
        self.eps = model.model.layers[0].input_layernorm.variance_epsilon
        self.final_eps = model.model.norm.variance_epsilon
        self.dtype = dtype or next(model.parameters()).dtype   # the weight values' precision
        self.compute = compute  # "auto" = `compute_dtype(self.dtype, device, ...)`, chosen in `prepare`
        self._fp32_bytes = 4 * sum(p.weight.numel() for layer in model.model.layers
                                   for p in (*layer.self_attn.children(), *layer.mlp.children()) if hasattr(p, "weight"))
        self.compute_dtype = self.dtype if compute == "auto" else compute
        self.weights = FusedWeights(model, dtype, self.compute_dtype)
        self._rope_len, self._rope_device = 0, None

    def prepare(self, max_positions: int, device: torch.device) -> None:
        """Refresh the fused weights and tabulate RoPE for positions [0, max_positions) as complex rotations.

        The model's own rotary module fills the table (in fp32, so scaled-rope variants and their
        attention scaling are honoured); a step then gathers rows of it.
        """
        if self.compute == "auto":
            chosen = compute_dtype(self.dtype, device, self._fp32_bytes)
            if chosen != self.compute_dtype:
                self.compute_dtype = self.weights.compute = chosen
                self.weights.invalidate()
        self.weights.refresh()
        # a bf16 cache where the step computes in bf16 and the C attention reads it: the keys and values are
        # bf16 matmul outputs already, so it only rounds the rotated key once more, as a bf16 HF forward
        # does, and halves the bytes each step reads (departure 5)
        self.cache_dtype = torch.bfloat16 if self.compute_dtype == torch.bfloat16 and self.gathers_rows(device) \
            else torch.float32
        if max_positions <= self._rope_len and self._rope_device == device:
            return
        probe = torch.zeros(1, 1, 1, dtype=torch.float32, device=device)
        cos, sin = self.model.model.rotary_emb(probe, torch.arange(max_positions, device=device)[None])
        cos, sin, half = cos[0].float(), sin[0].float(), self.head_dim // 2
        if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
            raise ValueError("FusedDecoder: the rotary module's cos/sin halves differ (not rotate_half RoPE); "
                             "use kernels='hf'")
        self._rot = torch.complex(cos[:, :half].contiguous(), sin[:, :half].contiguous())  # (L, D/2) complex64
        self._rope_len, self._rope_device = max_positions, device

    def _check_positions(self, positions: Tensor) -> None:
        top = int(positions.max())
        if top >= self._rope_len:
            raise RuntimeError(f"FusedDecoder: position {top} beyond prepare({self._rope_len})")

    def __call__(self, ids: Tensor, positions: Tensor, cache: KVCache, key_mask: Tensor,
                 decode_rows: int | None = None) -> Tensor:
        """Any number q of new tokens (prefill). Shapes: ids/positions (R, q) long; key_mask (R, ≥ length + q)
        bool → logits (R, V) fp32.

        The matmuls and the MLP run on the real tokens only (left-padding rows are dropped, departure 9);
        attention runs on the padded (R, q) layout, where pads are masked. `decode_rows`: the rows the
        decode steps after this prefill will run; when their matmul form is oneDNN's packed GEMM, the
        prefill multiplies by those packed weights too (packed here rather than at the first step), which
        beats `F.linear` on the plain copies at prefill sizes (AMD EPYC, 2 threads, tiny-30m's 40 matmuls:
        44 tokens bf16 7.8 vs 10.3 ms, fp32 15.6 vs 24.4 ms; 731 tokens bf16 113 vs 140 ms, fp32 205 vs
        285 ms); otherwise `F.linear`.
        """
        w, hq, hkv, d = self.weights, self.heads, self.kv_heads, self.head_dim
        rows, q = ids.shape
        packed, head = None, None                                          # the decode step's packed projections
        kind = None if decode_rows is None else self._kind(decode_rows, ids.device)
        if kind in ("dnn", "c"):
            packed, head = w.projections(kind, decode_rows)                # packed now, reused by the plan
        self._check_positions(positions)
        kv_len = cache.length + q
        real = key_mask[:, cache.length: kv_len].reshape(-1)               # (R·q,) the new tokens that are not pads
        keep = None if bool(real.all()) else real.nonzero()[:, 0]          # (N,) packed → padded row index
        h = F.embedding(ids.reshape(-1) if keep is None else ids.reshape(-1)[keep], w.embed)  # (N, H)
        rot = self._rot[positions][:, :, None]                            # (R, q, 1, D/2)
        # causal over the new block, pads masked; a pad query sees itself (no empty row → no NaN)
        causal = torch.ones(q, kv_len, dtype=torch.bool, device=ids.device).tril(kv_len - q)
        eye = torch.zeros_like(causal)
        eye[:, kv_len - q:] = torch.eye(q, dtype=torch.bool, device=ids.device)
        mask = ((causal[None] & key_mask[:, None, :kv_len]) | eye[None])[:, None]   # (R, 1, q, S)
        for i, lw in enumerate(w.layers):
            lp = None if packed is None else packed[i]
            x = _normalise(h, self.eps)
            qkv = (F.linear(x, lw.wqkv, lw.bqkv) if lp is None else lp.qkv(x)).float()  # (N, (Hq + 2·Hkv)·D)
            if keep is not None:                                           # back to the padded layout, pads = 0
                qkv = qkv.new_zeros(rows * q, qkv.shape[1]).index_copy_(0, keep, qkv)
            qkv = qkv.view(rows, q, -1, d)                                 # (R, q, heads, D)
            qk = torch.view_as_complex(qkv[:, :, : hq + hkv].unflatten(-1, (d // 2, 2))) * rot
            qk = torch.view_as_real(qk).flatten(-2)                       # (R, q, Hq + Hkv, D), rotated
            keys, values = cache.write(i, qk[:, :, hq:].transpose(1, 2), qkv[:, :, hq + hkv:].transpose(1, 2))
            if keys.dtype != torch.float32:                                # a bf16 cache: attention stays fp32
                keys, values = keys.float(), values.float()
            a = F.scaled_dot_product_attention(qk[:, :, :hq].transpose(1, 2), keys, values, attn_mask=mask,
                                               scale=self.scaling, enable_gqa=hq != hkv)  # (R, Hq, q, D)
            a = a.transpose(1, 2).reshape(rows * q, hq * d)
            a = (a if keep is None else a[keep]).to(h.dtype)                # (N, Hq·D)
            h = h + (F.linear(a, lw.wo, lw.bo) if lp is None else lp.o(a))
            x = _normalise(h, self.eps)
            gate, up = (F.linear(x, lw.wgu) if lp is None else lp.gu(x)).chunk(2, dim=-1)
            act = F.silu(gate) * up
            h = h + (F.linear(act, lw.wd) if lp is None else lp.d(act))
        cache.advance(q)
        # each row's last new token is real (left padding): its packed index is the running count − 1
        last_index = torch.arange(rows, device=ids.device) * q + q - 1 if keep is None else \
            real.view(rows, q).long().cumsum(-1)[:, -1].cumsum(0) - 1
        last = _normalise(h[last_index], self.final_eps)                 # (R, H)
        return (F.linear(last, w.lm_head, w.lm_head_bias) if head is None else head(last)).float()  # (R, V)

    def _kind(self, rows: int, device: torch.device) -> str:
        """The decode-step matmul form for `rows` rows."""
        if self.matmul != "auto":
            return self.matmul
        return tuned_kind(self.weights, self.compute_dtype, rows, device)

    def decode_library(self, device: torch.device) -> ctypes.CDLL | None:
        """The C kernels (`ckernels.py`) the decode step calls between its matmuls, or None for PyTorch ops."""
        forced = self.decode_ops.startswith("c")
        if self.decode_ops == "torch" or device.type != "cpu":
            if forced:
                raise ValueError(f"FusedDecoder: decode_ops={self.decode_ops!r} runs on a CPU only, not {device}")
            return None
        lib = ckernels.decode_library(generic=self.decode_ops == "c-generic")
        if lib is None and forced:
            raise ValueError(f"FusedDecoder: decode_ops={self.decode_ops!r} but the C kernels did not build "
                             f"(see the warning above)")
        return lib

    def gathers_rows(self, device: torch.device) -> bool:
        """Whether `plan` takes `cache_rows` here: the C attention kernel runs (it reads each row's keys
        and values where they are), so compaction needs no copy of the cache."""
        return (self.decode_library(device) is not None and ckernels.supports(self.heads, self.kv_heads, self.head_dim)
                and self.compute_dtype in (torch.float32, torch.bfloat16))

    def plan(self, cache: KVCache, key_mask: Tensor, cache_rows: Tensor | None = None) -> DecodePlan:
        """A one-token-per-row step bound to `cache` (rebuild after the cache's rows change).

        `cache_rows` (R,) int64: the cache row of each running row, where `gathers_rows` (else the
        cache's rows are the running rows, in order)."""
        device = cache.keys[0].device
        rows = cache.rows if cache_rows is None else cache_rows.numel()
        return DecodePlan(self, cache, key_mask, self._kind(rows, device), self.decode_library(device), cache_rows)


class DecodePlan:
    """One decode step (q = 1 new token per row) with pre-allocated buffers (departure 6).

    Bound to one cache and its rows; `key_mask` (R, capacity) bool marks the key slots a row may
    attend to (its real prompt tokens and every generated slot). Call: `plan(tokens (R,), positions (R,))`
    → logits (R, V) fp32, valid until the next call. With `cache_rows` (C attention only), running row
    r reads and writes cache row `cache_rows[r]`.
    """

    def __init__(self, dec: FusedDecoder, cache: KVCache, key_mask: Tensor, kind: str = "mm",
                 lib: ctypes.CDLL | None = None, cache_rows: Tensor | None = None):
        w, dt, f32 = dec.weights, dec.compute_dtype, torch.float32
        if cache_rows is not None:
            cache_rows = cache_rows.to(torch.int64).contiguous()           # the kernel reads it by pointer
            if cache_rows.numel() and not 0 <= int(cache_rows.min()) <= int(cache_rows.max()) < cache.rows:
                raise ValueError(f"DecodePlan: cache_rows must index the cache's {cache.rows} rows")
        rows = cache.rows if cache_rows is None else cache_rows.numel()
        cap, dev = cache.capacity, cache.keys[0].device
        hq, hkv, d, hidden = dec.heads, dec.kv_heads, dec.head_dim, dec.hidden
        if cache.keys[0].dtype not in (f32, torch.bfloat16):
            raise ValueError(f"DecodePlan: the KV cache must be fp32 or bf16 (FusedDecoder.cache_dtype), "
                             f"got {cache.keys[0].dtype}")
        if key_mask.shape != (rows, cap):
            raise ValueError(f"DecodePlan: key_mask has shape {tuple(key_mask.shape)}, expected {(rows, cap)}")
        self.dec, self.cache, self.rows, self.kind = dec, cache, rows, kind
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
        if cache_rows is None and cache.keys[0].dtype == f32:              # the PyTorch attention's cache views
            self.k_cache_c = [as_c(k, rows, hkv, cap) for k in cache.keys]  # (R, Hkv, cap, D/2) complex
            self.k_flat = [k.view(rows * hkv, cap, d) for k in cache.keys]   # (R·Hkv, cap, D)
            self.v_flat = [v.view(rows * hkv, cap, d) for v in cache.values]
        bias = torch.zeros(rows, hkv, 1, cap, dtype=f32, device=dev)
        self.bias = bias.masked_fill_(~key_mask[:, None, None, :], float("-inf")).view(rows * hkv, 1, cap)
        self.inv_hidden = 1.0 / hidden
        # mean h² as a batched dot product is the cheapest form for one row or a short hidden size; for
        # longer rows its per-row GEMV loses to a plain reduction, worst with 2 threads (1 / 2 threads, µs
        # per norm, bmm vs mean: 64 × 128: 9 vs 15 / 9 vs 14; 1 × 512: 4 vs 12; 8 × 512: 16 vs 13 / 35 vs
        # 14; 16 × 512: 27 vs 15 / 93 vs 16; 64 × 512: 94 vs 20 / 58 vs 37)
        self.ms_rows = self.ms.view(rows, 1)
        self._normalise = self._normalise_bmm if rows == 1 or hidden <= 256 else self._normalise_mean
        self._norm, self._attention, self._swiglu = self._norm_torch, self._attention_torch, self._swiglu_torch
        self.lib, self.cache_rows = lib, cache_rows
        if lib is not None:
            self._bind_c(lib, key_mask)
        if cache_rows is not None and self._attention == self._attention_torch:
            raise ValueError("DecodePlan: cache_rows needs the C attention kernel (FusedDecoder.gathers_rows)")
        if cache.keys[0].dtype != f32 and self._attention == self._attention_torch:
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
        self._normalise(self.final_eps if final else self.eps)

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

        def normalise(final: bool) -> None:
            norm(rows, hidden, *h, final_eps if final else eps, *x, threads)

        swiglu, inter = lib.posttrain_silu_mul, self.act.shape[1]
        gu_act = (self.gu.data_ptr(), self.act.data_ptr(), is_bf16(self.gu))

        def silu_mul() -> None:
            swiglu(rows, inter, *gu_act, threads)

        self._norm, self._swiglu = normalise, silu_mul
        if not ckernels.supports(hq, hkv, d):
            return
        self.bias_rows = torch.zeros(rows, cap, dtype=f32).masked_fill_(~key_mask, float("-inf"))
        self.scratch = torch.empty(threads, lib.posttrain_scratch_floats(hq // hkv, cap, d), dtype=f32)
        head = (rows, hq, hkv, d, cap)
        middle = (self.qkv.data_ptr(), is_bf16(self.qkv), self.qkv.shape[1], self.rot.data_ptr())
        tail = (self.bias_rows.data_ptr(), dec.scaling, self.attn_w.data_ptr(), is_bf16(self.attn_w),
                self.attn_w.shape[1], self.scratch.data_ptr(), threads)
        rows_of = 0 if self.cache_rows is None else self.cache_rows.data_ptr()  # 0: NULL, row r is cache row r
        kv_bf16 = int(self.cache.keys[0].dtype == bf16)
        caches = [(k.data_ptr(), v.data_ptr(), kv_bf16, rows_of) for k, v in zip(self.cache.keys, self.cache.values)]
        attend = lib.posttrain_decode_attention

        def attention(i: int, slot: int) -> None:
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
            self._norm(False)
            lp.qkv.into(self.x, self.qkv)
            self._attention(i, slot)
            lp.o.add_to(self.attn_w, self.h)
            self._norm(False)
            lp.gu.into(self.x, self.gu)
            self._swiglu()
            lp.d.add_to(self.act, self.h)
        cache.advance(1)
        self._norm(True)
        return self.lm_head(self.x).float()                               # (R, V)
