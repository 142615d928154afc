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
   oneDNN weights, our own packed matmul (`c`, `ckernels.py`), or a pre-transposed (in, out) copy
   multiplied with `torch.mm`/`addmm` — MKL's sgemm runs "NN" up to 2× faster than `F.linear`'s "NT"
   at 8 rows on an Intel Xeon (docs/rollout.md). The fastest form depends on the CPU (on an AMD EPYC
   oneDNN beats MKL everywhere, by 2–4×, and ours beats both at most sizes), so it is measured on the
   machine (`tuning.tuned_kind`); `projection_kind` is the static prior (`projections.py`). Prefill
   uses the decode step's packed weights when its form is oneDNN's or ours, else `F.linear` on the
   (out, in) copies.
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
11. LoRA (`models.lora`): an adapted projection is read as its merged weight W₀ + (α/r)·B·A, computed
   at each rebuild into a scratch buffer of its shape that every layer reuses, then folded and copied
   as above (o_proj/down_proj in fp32, which are otherwise the parameters themselves, get their own
   copy); the module is never merged or rebuilt, and disabling the adapters rebuilds from W₀. Adapters
   elsewhere (the embedding) or of another kind (DoRA) are refused with the reason
   (`fused_unsupported_reason`); the engine then runs the HF forward, adapters unmerged.
12. The n samples of a prompt read its keys and values from one copy: with the C attention the engine
   keeps the prefill's cache (one row per prompt) as the decode's `prefix` and gives each sample a cache
   of its own for the tokens it generates; the kernel reads a row's prompt positions, then its own, in
   one loop (the same sums in the same order as one cache holding both: the same bits). Elsewhere the
   prefill's cache is copied into every sample's row (`KVCache.expand`).
`HFForward` in `native.py` is the naive version; `FusedDecoder.__call__` (any number of new tokens)
is the reference for `DecodePlan` (one); `tests/test_rollout_native.py` proves all three agree.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.models import lora
from posttrain.rollout.cpu import ckernels
from posttrain.rollout.cpu.decode_plan import DecodePlan
from posttrain.rollout.kv_cache import KVCache
from posttrain.rollout.cpu.projections import PROJECTION_KINDS, MatmulForm, compute_dtype, form_of, make_projection
from posttrain.rollout.cpu.tuning import tuned_kind

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
    return lora_unsupported_reason(model)


def lora_unsupported_reason(model: nn.Module) -> str | None:
    """None if every LoRA adapter of `model` sits on a decoder projection the fused path merges
    (`FusedWeights`, departure 11), else which one does not."""
    merged = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
    for name, module in model.named_modules():
        if not lora.active_adapters(module):
            continue
        if name.rsplit(".", 1)[-1] not in merged:
            return f"a LoRA adapter on {name} (the fused path merges adapters on {sorted(merged)} only)"
        reason = lora.unmergeable_reason(module)
        if reason is not None:
            return f"{name}: {reason}"
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
        self._scratch: dict[tuple, Tensor] = {}  # merged LoRA weights, one per shape (`_w`)
        self.layers: list[_Layer] = []
        self._projections: dict[str, tuple[int, list[_LayerProjections], MatmulForm]] = {}
        self._released: dict[str, int] = {}  # the decode forms (kind → rows) `release` dropped: `rebuild` remakes them
        self.moved_bytes = 0

    def _version(self) -> tuple:
        # A parameter's `_version` moves on every in-place write (optimizer.step, load_state_dict, copy_),
        # and `data_ptr` moves when it is replaced: together they say when the copies are stale. LoRA
        # adapters are parameters too; whether they act (disabled or not) is the last part of the key.
        return tuple((p.data_ptr(), p._version) for p in self._params), lora.adapter_state(self.model)

    def _w(self, linear: nn.Module) -> Tensor:
        """The weight `linear` multiplies by: its parameter (a detached view), or with active LoRA adapters
        W₀ + (α/r)·B·A merged into a scratch buffer of that shape, reused by every layer (departure 11:
        whatever reads it copies it at once; `_copy` keeps a persistent copy where it would not)."""
        if not lora.active_adapters(linear):
            return linear.weight.detach()
        w = linear.weight
        key = (tuple(w.shape), w.dtype, w.device)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = torch.empty_like(w, requires_grad=False)
        return lora.merged_weight(linear, out=buf)

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

    def _fold(self, w: Tensor, norm: Tensor | None, out: Tensor, heads: int = 0, d: int = 0) -> None:
        """out ← w · norm (the norm weight folded into the columns; None: a cast), in out's dtype; with `heads`,
        each head's D rows of w taken in `pair_halves` order (departure 4: `_paired`). fp32 into bf16 on a CPU
        is one pass of the C kernel (`posttrain_fold_bf16`, the same bits as `torch.mul`; tiny-30m's whole refresh
        13.3 → 10.5 ms, 1 thread); else `torch.mul` (or `copy_`) on the strided view, the pairing its read."""
        lib = ckernels.decode_library() if w.device.type == "cpu" else None
        if (lib is not None and w.dtype == torch.float32 and out.dtype == torch.bfloat16 and w.is_contiguous()
                and out.is_contiguous() and (norm is None or (norm.dtype == torch.float32 and norm.is_contiguous()))):
            rows = _pair_rows(heads, d, w.device) if heads else None
            lib.posttrain_fold_bf16(out.shape[0], out.shape[1], w.data_ptr(), None if rows is None else rows.data_ptr(),
                                    None if norm is None else norm.data_ptr(), out.data_ptr(), torch.get_num_threads())
            return
        if heads:
            w, out = _paired(w, heads, d), out.view(heads, d // 2, 2, w.shape[1])
        if norm is None:
            out.copy_(w)
        else:
            torch.mul(w, norm, out=out)

    def _copy(self, name: str, w: Tensor, norm: Tensor | None = None) -> Tensor:
        """w (out, in) with the norm weight folded into its columns, in the copies' dtype. An fp32 weight
        with nothing to fold is returned as is (a detached view of the parameter)."""
        w = w.detach()
        if norm is None and w.dtype == self._dt and not any(w.data_ptr() == s.data_ptr() for s in self._scratch.values()):
            return w
        out = self._buffer(name, tuple(w.shape), w)
        self.moved_bytes += w.nbytes + out.nbytes
        self._fold(w, None if norm is None else norm.detach(), out)
        return out

    def _qkv(self, name: str, a: nn.Module, norm: Tensor, heads: int, kv_heads: int, d: int) -> Tensor:
        """[W_q; W_k; W_v] with the norm folded and each Q/K head's rows in `pair_halves` order (departure 4):
        the pairing is the view (heads, 2, D/2, H) → (heads, D/2, 2, H), so the gather is the fold's read."""
        hidden = a.q_proj.weight.shape[1]
        out = self._buffer(name, ((heads + 2 * kv_heads) * d, hidden), a.q_proj.weight)
        n = norm.detach()
        self._fold(self._w(a.q_proj), n, out[: heads * d], heads, d)
        self._fold(self._w(a.k_proj), n, out[heads * d : (heads + kv_heads) * d], kv_heads, d)
        self._fold(self._w(a.v_proj), n, out[(heads + kv_heads) * d :])
        self.moved_bytes += a.q_proj.weight.nbytes + a.k_proj.weight.nbytes + a.v_proj.weight.nbytes + out.nbytes
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
        self.moved_bytes = 0  # bytes this build reads and writes (the `sync` phase's cost)
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
            self._fold(self._w(mlp.gate_proj), norm, wgu[: gate.shape[0]])  # each merged weight is read
            self._fold(self._w(mlp.up_proj), norm, wgu[gate.shape[0]:])     # before the next one is merged
            self.moved_bytes += gate.nbytes + up.nbytes + wgu.nbytes
            layers.append(_Layer(
                wqkv=self._qkv(f"{i}.qkv", a, layer.input_layernorm.weight, heads, kv_heads, d),
                bqkv=bqkv,
                wo=self._copy(f"{i}.o", self._w(a.o_proj)),
                bo=None if a.o_proj.bias is None else a.o_proj.bias.detach().to(dt),
                wgu=wgu,
                wd=self._copy(f"{i}.d", self._w(mlp.down_proj)),
            ))
        embed = self._copy("embed", m.model.embed_tokens.weight)                # (V, H)
        lm_head = self._copy("lm_head", self._w(m.lm_head), m.model.norm.weight)  # (V, H), final norm folded
        bias = getattr(m.lm_head, "bias", None)
        lm_head_bias = None if bias is None else bias.detach().to(dt)
        if self.compute is not None and self.compute != dt:                    # the rounded values, widened
            self._dt = self.compute
            def widen(name: str, t: Tensor | None) -> Tensor | None:
                if t is None:
                    return None
                out = self._buffer(name + ".w", tuple(t.shape), t).copy_(t)
                self.moved_bytes += t.nbytes + out.nbytes
                return out
            layers = [_Layer(**{f: widen(f"{i}.{f}", getattr(lw, f)) for f in _Layer.__dataclass_fields__})
                      for i, lw in enumerate(layers)]
            embed, lm_head, lm_head_bias = widen("embed", embed), widen("lm_head", lm_head), widen("lm_bias", lm_head_bias)
        self.layers, self.embed, self.lm_head, self.lm_head_bias = layers, embed, lm_head, lm_head_bias
        self._projections = {}
        self.nbytes = sum(t.numel() * t.element_size() for lw in self.layers for t in (lw.wqkv, lw.wo, lw.wgu, lw.wd))
        self._key = key

    def rebuild(self) -> int:
        """Rebuild now, not at the next `refresh`: the copies, and the decode forms the last generate used
        (same kinds and rows). Returns the bytes read and written — what moving the weights to the
        engine cost (the stages time it as the `sync` phase). Never built yet: nothing to rebuild (0)."""
        if self._key is None and not self.layers and not self._released:
            return 0
        last = {kind: rows for kind, (rows, _, _) in self._projections.items()} or self._released
        self._released = {}
        self.invalidate()
        self.refresh()
        moved = self.moved_bytes
        for kind, rows in last.items():
            layers, head = self.projections(kind, rows)
            for proj in [head, *(p for lp in layers for p in (lp.qkv, lp.o, lp.gu, lp.d))]:
                written = proj.packed.nbytes if proj.packed is not None else (proj.w.nbytes if kind == "mm" else 0)
                moved += proj.w.nbytes + written
        return moved

    def release(self) -> int:
        """Free the fused copies and the decode forms; returns the bytes freed. The next `rebuild` (the
        stage's `sync`) or `refresh` builds them again, with the decode forms the last generate used. A
        policy's weights change at every optimizer step, so the copies are rebuilt after it anyway: freeing
        them before the update costs their allocation, and takes them out of the update's memory peak."""
        freed = self.resident_bytes()
        self._released = {kind: rows for kind, (rows, _, _) in self._projections.items()} or self._released
        self._buffers, self._scratch, self._projections, self.layers = {}, {}, {}, []
        self.embed = self.lm_head = self.lm_head_bias = None
        self._key = None
        return freed

    def resident_bytes(self) -> int:
        """Bytes this engine holds beyond the model's own parameters: the fused copies and decode forms."""
        own = {id(b) for b in self._buffers.values()}
        total = sum(b.nbytes for b in self._buffers.values())
        for _, layers, head in self._projections.values():
            for proj in [head, *(p for lp in layers for p in (lp.qkv, lp.o, lp.gu, lp.d))]:
                if proj.packed is not None:
                    total += proj.packed.nbytes
                elif proj.kind == "mm" and id(proj.w) not in own:
                    total += proj.w.nbytes
        return total

    def projections(self, kind: str, rows: int) -> tuple[list[_LayerProjections], MatmulForm]:
        """Every decode matmul in form `kind` for `rows` rows; the last build per kind is kept (packing
        costs about one pass over the weights, so a plan rebuilt for the same rows reuses it; the form
        says which row counts a build serves, `MatmulForm.reuses`). A compaction of the batch rebuilds
        the plan, not the weights."""
        cached = self._projections.get(kind)
        if cached is not None and form_of(kind).reuses(cached[0], rows):
            return cached[1], cached[2]
        layers = [_LayerProjections(qkv=make_projection(lw.wqkv, lw.bqkv, kind, rows),
                                    o=make_projection(lw.wo, lw.bo, kind, rows),
                                    gu=make_projection(lw.wgu, None, kind, rows),
                                    d=make_projection(lw.wd, None, kind, rows))
                  for lw in self.layers]
        lm_head = make_projection(self.lm_head, self.lm_head_bias, kind, rows)
        self._projections[kind] = (rows, layers, lm_head)
        return layers, lm_head


@functools.cache
def _pair_rows(heads: int, d: int, device: torch.device) -> Tensor:
    """The row of w each row of `_paired(w, heads, d)` is, as int64: the fold kernel's gather."""
    return _paired(torch.arange(heads * d, device=device), heads, d).reshape(-1).contiguous()


def _paired(w: Tensor, heads: int, d: int) -> Tensor:
    """Rows (heads·D, …) viewed as (heads, D/2, 2, …) in `pair_halves` order: element (h, i, j) is row h·D + j·D/2 + i."""
    return w.view(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2)


@dataclass
class _LayerProjections:
    qkv: MatmulForm
    o: MatmulForm
    gu: MatmulForm
    d: MatmulForm


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
        decode steps after this prefill will run; when their matmul form is a packed one (oneDNN's or
        ours, `c`), the prefill multiplies by those packed weights too (packed here rather than at the first step), which
        beats `F.linear` on the plain copies at prefill sizes (AMD EPYC, 2 threads, tiny-30m's 40 matmuls:
        44 tokens bf16 7.8 vs 10.3 ms, fp32 15.6 vs 24.4 ms; 731 tokens bf16 113 vs 140 ms, fp32 205 vs
        285 ms); otherwise `F.linear`.
        """
        w, hq, hkv, d = self.weights, self.heads, self.kv_heads, self.head_dim
        rows, q = ids.shape
        packed, head = None, None                                          # the decode step's packed projections
        kind = None if decode_rows is None else self._kind(decode_rows, ids.device)
        if kind is not None and form_of(kind).packs_for_prefill:
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
        """Whether `plan` takes `cache_rows` and `prefix` here: the C attention kernel runs (it reads each
        row's keys and values where they are), so compaction needs no copy of the cache, and a prompt's
        samples need no copy of its keys and values (departure 12)."""
        return (self.decode_library(device) is not None and ckernels.supports(self.heads, self.kv_heads, self.head_dim)
                and self.compute_dtype in (torch.float32, torch.bfloat16))

    def plan(self, cache: KVCache, key_mask: Tensor, cache_rows: Tensor | None = None, *,
             prefix: KVCache | None = None, share: int = 1) -> DecodePlan:
        """A one-token-per-row step bound to `cache` (rebuild after the cache's rows change).

        Where `gathers_rows`: `cache_rows` (R,) int64, the cache row of each running row (else the cache's
        rows are the running rows, in order); `prefix`, keys and values cache row c attends to before its
        own, at prefix row c // `share` (departure 12)."""
        device = cache.keys[0].device
        rows = cache.rows if cache_rows is None else cache_rows.numel()
        return DecodePlan(self, cache, key_mask, self._kind(rows, device), self.decode_library(device), cache_rows,
                          prefix=prefix, share=share)
